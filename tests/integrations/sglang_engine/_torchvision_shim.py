"""Stand-in for ``torchvision`` when only its CUDA build exists (PyPI's linux wheels cannot load on the
CPU torch these tests use: ``operator torchvision::nms does not exist``). SGLang 0.5.23 imports
``torchvision.transforms`` at module level on the import path of its memory pools (``srt.configs``
-> a multimodal model's image utilities, and transformers' processors); nothing on the KV-cache path
calls it. Every ``torchvision.*`` module resolves to a placeholder whose attributes raise when used."""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name} is unavailable (CPU test stand-in for torchvision)")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")

    def __mro_entries__(self, bases):  # usable as a base class at import time
        return (object,)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__file__ = f"<torchvision stand-in: {spec.name}>"
        m.__path__ = []
        m.__version__ = "0.0.0+cpu-stand-in"

        def getattr_(item, _n=spec.name):
            if item.startswith("__"):
                raise AttributeError(item)
            return _Unavailable(f"{_n}.{item}")

        m.__getattr__ = getattr_
        return m

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


def install() -> bool:
    """Install the stand-in unless a working torchvision is importable; True if installed."""
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
