

def method_runner(method: str):
    """`run(recipe, log)` of a recipe's method: the module of that name (ORPO and SimPO share one)."""
    import importlib

    module = {"orpo": "reference_free", "simpo": "reference_free"}.get(method, method)
    return importlib.import_module(f"erniekit_lite.train.{module}").run
