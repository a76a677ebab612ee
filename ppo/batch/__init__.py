"""The step's data: samples and the typed step batch, micro-batching and packing, the advantage stage."""
