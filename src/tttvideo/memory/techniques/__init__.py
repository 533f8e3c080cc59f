"""Memory techniques as objects: what each is, sets, applies, counts, costs, calibrates and advises
(`technique`); those the project offers, by what they act on (`activations`, `weights`, `sampling`, `parallel`,
sharing `common`), and the registry that orders them (`registry`)."""

from tttvideo.memory.techniques.activations import (ACTIVATION_OFFLOAD, CHECKPOINTING, FFN_CHUNK_TOKENS, FFN_CHUNKS,
                                                    NESTED_CHECKPOINTING, SUB_BLOCK_POLICY, WHOLE_BLOCK_POLICY,
                                                    WINDOW_FORM, checkpoint_policy, mlp_hidden, nested_span_for,
                                                    window_form)
from tttvideo.memory.techniques.parallel import SEQUENCE_PARALLEL, sp_degrees
from tttvideo.memory.techniques.registry import REGISTRY, calibration_setups, check_techniques, techniques
from tttvideo.memory.techniques.sampling import CHUNKED_INFERENCE, GUIDANCE_PASSES, SAMPLE_BLOCK_OFFLOAD
from tttvideo.memory.techniques.technique import (CalibrationSetup, Footprint, MemoryTechnique, ModelBytes, Option,
                                                  Saving, optimizer_state_bytes, quantised_by_adamw8bit)
from tttvideo.memory.techniques.weights import ADAMW_8BIT, FP8_EVERY_LINEAR, FP8_STREAMING, FP8_WEIGHTS

__all__ = ["ACTIVATION_OFFLOAD", "ADAMW_8BIT", "CHECKPOINTING", "CHUNKED_INFERENCE", "FFN_CHUNK_TOKENS", "FFN_CHUNKS",
           "FP8_EVERY_LINEAR", "FP8_STREAMING", "FP8_WEIGHTS", "GUIDANCE_PASSES", "NESTED_CHECKPOINTING", "REGISTRY",
           "SAMPLE_BLOCK_OFFLOAD", "SEQUENCE_PARALLEL", "SUB_BLOCK_POLICY", "WHOLE_BLOCK_POLICY", "WINDOW_FORM",
           "CalibrationSetup", "Footprint", "MemoryTechnique", "ModelBytes", "Option", "Saving", "calibration_setups",
           "check_techniques", "checkpoint_policy", "mlp_hidden", "nested_span_for", "optimizer_state_bytes",
           "quantised_by_adamw8bit", "sp_degrees", "techniques", "window_form"]
