"""Planning: choose the K of every EXL3 target (uniform, our allocator, or exllamav3's own strategy),
read and write exllamav3 recipes. The plan itself and its rules are the pack contract
(quantizer/contract/); which tensors are EXL3 targets is the model's (quantizer/model/targets.py)."""

from quantizer.plan.recipe import Recipe, plan_from_recipe, read_recipe, write_recipe
from quantizer.plan.uniform import uniform_plan

__all__ = ["Recipe", "plan_from_recipe", "read_recipe", "uniform_plan", "write_recipe"]
