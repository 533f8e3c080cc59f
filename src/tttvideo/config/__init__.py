from tttvideo.config.schema import (Config, DataConfig, LayoutConfig, ModelConfig, ParallelConfig,
                                    SampleConfig, TrainConfig, TTTConfig)

__all__ = ["Config", "DataConfig", "LayoutConfig", "ModelConfig", "ParallelConfig", "SampleConfig",
           "TrainConfig", "TTTConfig"]
