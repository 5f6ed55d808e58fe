"""Make SGLang's scheduler importable where triton and torchvision are absent (CPU).

SGLang ships stubs for platforms without triton (`sglang/_platform_stubs.py`) but
installs them only on Apple silicon. Its scheduler bookkeeping never launches a
kernel, so the same stubs let it run on CPU: this module loads that file by path
(importing `sglang` itself would import triton first) and registers its triton
finder, leaving torch untouched (no MPS patches). torchvision (a compiled package
tied to one torch build) is imported only by SGLang's multimodal processors, which
its config registry imports eagerly; the same mock modules stand in for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

# How to install what SGLang's scheduler needs: docs/sglang.md#install's two commands.
INSTALL = (
    "beside SGLang 0.5.23, pip install '.[sglang]' from a batchstate checkout; on a CPU,"
    " pip install 'torch==2.13.0' -e '.[dev,sglang]' && pip install --no-deps 'sglang==0.5.23'"
    " (docs/sglang.md#install)"
)


def _require_sglang() -> None:
    """SGLang and the `sglang` extra (transformers first) are installed, or an ImportError
    that says how to install them, before anything imports either."""
    missing = [
        name
        for name in ("sglang", "transformers")
        if sys.modules.get(name) is None and importlib.util.find_spec(name) is None
    ]
    if missing:
        names = " and ".join(missing)
        raise ImportError(
            f"batchstate.sglang runs SGLang's scheduler; {names} not installed: {INSTALL}"
        )


def _load_sglang_stubs() -> ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"sglang is not installed: {INSTALL}")
    location = next(iter(spec.submodule_search_locations))
    stub_spec = importlib.util.spec_from_file_location(
        "batchstate_sglang_platform_stubs", f"{location}/_platform_stubs.py"
    )
    if stub_spec is None or stub_spec.loader is None:
        raise ImportError(f"sglang at {location} has no _platform_stubs.py")
    module = importlib.util.module_from_spec(stub_spec)
    sys.modules[stub_spec.name] = module  # its dataclasses look their module up
    stub_spec.loader.exec_module(module)
    return module


class _AnyModule(ModuleType):
    """A module whose every attribute is another such module, also callable: it only
    has to survive module-level code (`InterpolationMode.BICUBIC`, `T.Compose`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__spec__ = importlib.machinery.ModuleSpec(
            name, _AnyModuleLoader(self), is_package=True
        )

    def __getattr__(self, name: str) -> _AnyModule:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _AnyModule(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: object, **kwargs: object) -> object:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self


class _AnyModuleLoader(importlib.abc.Loader):
    """Hands the import system the module already made (not a fresh, plain one)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        return None


class _AnyModuleFinder:
    """Serves an `_AnyModule` for `name` and its submodules (`import name.x.y`)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name and not fullname.startswith(self._name + "."):
            return None
        parent, _, child = fullname.rpartition(".")
        module = getattr(sys.modules[parent], child) if parent else _AnyModule(fullname)
        sys.modules[fullname] = module
        return module.__spec__


def _absent(name: str) -> bool:
    return name not in sys.modules and importlib.util.find_spec(name) is None


def install_stubs() -> None:
    """Stub triton and torchvision where they are not importable; idempotent."""
    _require_sglang()
    if "sglang" not in sys.modules:
        # An earlier `import sglang` that failed (no triton) leaves its submodules
        # behind without their parent; importing SGLang again needs them gone.
        for name in [n for n in sys.modules if n.startswith("sglang.")]:
            del sys.modules[name]
    if _absent("torchvision"):
        # transformers caches whether torchvision is installed; ask it first, so it
        # keeps taking it as absent (a stub has no version to compare).
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        sys.meta_path.append(_AnyModuleFinder("torchvision"))
    if not _absent("triton"):
        return
    stubs = _load_sglang_stubs()
    sys.meta_path.insert(0, stubs._TritonFinder())
    triton = stubs._make_mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = stubs._cdiv
    triton.next_power_of_2 = stubs._next_power_of_2
    triton.Config = stubs._Config
    language = stubs._make_mock("triton.language")

    class _Constexpr:
        def __init__(self, value: object = None) -> None:
            self.value = value

    language.constexpr = _Constexpr
    triton.language = language
    # Types torch's inductor checks with isinstance (or raises) while it initialises.
    jit = stubs._make_mock("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {})
    jit.KernelInterface = type("KernelInterface", (stubs._StubBase,), {})
    stubs._make_mock("triton.runtime.cache").triton_key = stubs._triton_key
    autotuner = stubs._make_mock("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})
    compiler = stubs._make_mock("triton.compiler")
    compiler.CompiledKernel = type("CompiledKernel", (stubs._StubBase,), {})
    compiler_impl = stubs._make_mock("triton.compiler.compiler")
    compiler_impl.ASTSource = type("ASTSource", (stubs._StubBase,), {})
    compiler_impl.triton_key = stubs._triton_key
    backend = stubs._make_mock("triton.backends.compiler")
    backend.GPUTarget = type("GPUTarget", (stubs._StubBase,), {})
