"""Long-range sequence layers beside local attention, for the comparison of `benchmarks/long_range.py`: the gated
bidirectional wrapper they share with TTT (`bidirectional`), Mamba 2 and Gated DeltaNet over flash-linear-attention's
kernels (`mamba2`, `gated_deltanet` on the skeleton in `recurrent`, their recurrences in `recurrence` and `ops`),
and full attention over the whole video (`full_attention`). `build.sequence_layer` makes the one a config names."""
