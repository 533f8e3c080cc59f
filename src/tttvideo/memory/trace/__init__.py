"""Memory of model code traced op by op on fake tensors: what holds the memory of a block at full size, on the CPU
(`fake_trace`, `live_bytes`, `gpu_stand_ins`)."""
