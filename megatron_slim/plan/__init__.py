"""Pure planning core: recipes, cost model, schedules, simulator, planners. Imports no torch."""
