"""`quantizer publish`: a verified pack, with its card, to a Hugging Face model repository."""

from quantizer.publish.hub_upload import PublishPlan, pack_files, plan_publish, upload

__all__ = ["PublishPlan", "pack_files", "plan_publish", "upload"]
