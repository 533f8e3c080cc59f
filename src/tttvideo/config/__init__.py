from tttvideo.config.schema import (Config, DataConfig, LayoutConfig, MemoryConfig, ModelConfig, ParallelConfig,
                                    SampleConfig, TrainConfig, TTTConfig)

__all__ = ["Config", "DataConfig", "LayoutConfig", "MemoryConfig", "ModelConfig", "ParallelConfig", "SampleConfig",
           "TrainConfig", "TTTConfig"]
