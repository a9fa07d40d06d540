"""The build command: plan, quantize, pack and verify in one resumable work directory."""

from quantizer.orchestrate.stages import BuildRequest, BuildResult, build

__all__ = ["BuildRequest", "BuildResult", "build"]
