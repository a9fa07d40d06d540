"""The pack contract every stage reads: the plan, the pack spec and its stored linears, and the loader
profiles of the engines that run a pack."""
