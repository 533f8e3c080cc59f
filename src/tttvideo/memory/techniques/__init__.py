"""Memory techniques as objects: what each is, sets, applies, counts, costs, calibrates and advises
(`technique`), and the registry of those the project offers (`registry`)."""

from tttvideo.memory.techniques.registry import (ACTIVATION_OFFLOAD, ADAMW_8BIT, CHECKPOINTING, CHUNKED_INFERENCE,
                                                 FFN_CHUNK_TOKENS, FFN_CHUNKS, FP8_EVERY_LINEAR, FP8_STREAMING,
                                                 FP8_WEIGHTS, GUIDANCE_PASSES, NESTED_CHECKPOINTING, REGISTRY,
                                                 SAMPLE_BLOCK_OFFLOAD, SEQUENCE_PARALLEL, SUB_BLOCK_POLICY,
                                                 WHOLE_BLOCK_POLICY, WINDOW_FORM, calibration_setups, check_techniques,
                                                 checkpoint_policy, mlp_hidden, nested_span_for, sp_degrees,
                                                 techniques, window_form)
from tttvideo.memory.techniques.technique import (CalibrationSetup, Footprint, MemoryTechnique, ModelBytes, Option,
                                                  Saving, optimizer_state_bytes, quantised_by_adamw8bit)

__all__ = ["ACTIVATION_OFFLOAD", "ADAMW_8BIT", "CHECKPOINTING", "CHUNKED_INFERENCE", "FFN_CHUNK_TOKENS", "FFN_CHUNKS",
           "FP8_EVERY_LINEAR", "FP8_STREAMING", "FP8_WEIGHTS", "GUIDANCE_PASSES", "NESTED_CHECKPOINTING", "REGISTRY",
           "SAMPLE_BLOCK_OFFLOAD", "SEQUENCE_PARALLEL", "SUB_BLOCK_POLICY", "WHOLE_BLOCK_POLICY", "WINDOW_FORM",
           "CalibrationSetup", "Footprint", "MemoryTechnique", "ModelBytes", "Option", "Saving", "calibration_setups",
           "check_techniques", "checkpoint_policy", "mlp_hidden", "nested_span_for", "optimizer_state_bytes",
           "quantised_by_adamw8bit", "sp_degrees", "techniques", "window_form"]
