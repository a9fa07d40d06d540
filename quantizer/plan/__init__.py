"""Plans: the K of every EXL3 target, cold-expert aliases, expected bytes, exllamav3 recipes.

Which tensors are EXL3 targets is the model's (quantizer/model/targets.py)."""

from quantizer.plan.plan import Plan, check_plan, make_plan
from quantizer.plan.profiles import EXLLAMAV3, LOADERS, TENSORFOLD, VLLM_EXL3, load_profile
from quantizer.plan.recipe import Recipe, plan_from_recipe, read_recipe, write_recipe
from quantizer.plan.uniform import uniform_plan

__all__ = [
    "EXLLAMAV3", "LOADERS", "TENSORFOLD", "VLLM_EXL3", "Plan", "Recipe", "check_plan", "load_profile", "make_plan",
    "plan_from_recipe", "read_recipe", "uniform_plan", "write_recipe",
]
