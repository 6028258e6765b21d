"""The reference 3D-parallel training job (``python -m trainprof.reference --help``): a small
decoder-only transformer trained with DeviceMesh (dp, pp, tp), DTensor tensor parallel,
torch.distributed.pipelining and FSDP2, with fault injection for testing the analyzers."""
