"""One way to give another library's object a little of this project's behaviour: a subclass of its class.

The object's class is swapped for `same_named(cls, ...)`, a subclass named as `cls` is (so `repr`, `type(x).__name__`
and saved configs read as before) whose module says where the override lives. Nothing is set on the instance, and
`super()` reaches the library's own method. Callers cache the class (`functools.cache`) so each is made once.
"""


def same_named(cls: type, module: str, **attributes) -> type:
    """A subclass of `cls` with `attributes` (methods, class attributes), named `cls.__name__`, defined in `module`."""
    return type(cls.__name__, (cls,), {**attributes, "__module__": module, "__qualname__": cls.__qualname__})
