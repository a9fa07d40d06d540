"""quantizer: DeepSeek-V4.1-Flash native checkpoints to EXL3 packs for DGX Spark."""

__version__ = "0.1.0"
