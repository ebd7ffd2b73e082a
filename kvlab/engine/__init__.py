"""One run: the generation loop (read, compress, decode), static decoding captured in CUDA graphs, and the extra
passes some policies need (KVzip's reconstruction, a model's attention profile)."""
