"""Plans derived from a resolved config before anything runs: the GPU memory of every rank (`memory`,
`ranks`) and the known GPUs' memory (`gpus`). Torch-free."""
