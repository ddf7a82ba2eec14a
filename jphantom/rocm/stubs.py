"""Stand-ins for the ROCm runtime libraries the ROCm PJRT plugin links, so that XLA's AMD GPU
compiler loads on a machine without ROCm.

``jax-rocm7-pjrt``'s ``xla_rocm_plugin.so`` (and ``jax-rocm7-plugin``'s extension modules) name
about sixteen ROCm libraries as ``DT_NEEDED`` (``libamdhip64.so.7``, ``librccl.so.1``,
``libhsa-runtime64.so.1``, ``libMIOpen.so.1``...): the dynamic loader refuses the plugin unless
each is present, unlike the CUDA plugin, which opens CUDA's lazily. No package registry ships them
(``rocm-sdk-*`` on PyPI are placeholders). Compiling calls none of them: only the static
initialisers that register embedded kernels (``__hipRegisterFatBinary``/``Function``/``Var``) and
``rocprofiler_force_configure`` run at load, and the AMDGPU device libraries and lld are embedded
in the plugin (traced: no exec, no bitcode opened).

So, for each needed library that does not load here, :func:`ensure` compiles (gcc) a shared
object of that ``SONAME`` defining every symbol the plugin takes from it, under the symbol
versions the plugin asks for (``hip_4.2`` ... ``hip_6.5``, ``ROCR_1``, ``AMDSMI_1``,
``AMDROCM_SYSDEPS_1.0*``, read from its ``.gnu.version_r`` with readelf); the plugin's unversioned
undefined symbols that no system library defines go into the first unversioned stand-in. A
stand-in fails loudly when called: it prints its symbol's name to stderr and aborts, so that a
call that reaches one stops there instead of running on with a made-up result. Three kinds are
left working, because loading the plugin calls them or they are not code (:func:`kind_of`): the
static initialisers' registrations (``__hipRegister*``, ``__hipUnregister*`` at exit and
``rocprofiler_force_configure``) return a non-null handle, an error-string getter returns readable
text, and C++ vtables and typeinfo (``_ZTV``, ``_ZTI``, ``_ZTS``) are placeholders no one calls.
They are written once into a cache keyed by what they define (``$JPHANTOM_CACHE_DIR/rocm-stubs/
<key>``, else ``$XDG_CACHE_HOME/jphantom/rocm-stubs/<key>``, default ``~/.cache/jphantom``;
regenerated when the plugin's needs change) and loaded with ``RTLD_GLOBAL`` before jax discovers
the plugin.

**Never where ROCm is**: a library that loads is not stood in for; where every one loads (a real
ROCm install) nothing is generated or loaded. Anything that *runs* on a stand-in fails; jphantom
uses them only to compile (``jphantom compile --target rocm:...``), and says so in the report.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from jphantom.errors import ConfigError

_SYSTEM_VERSIONS = re.compile(r"^(GLIBC|GLIBCXX|CXXABI|GCC)_")
_STUB_BODY = (
    "#include <stdio.h>\n#include <stdlib.h>\n"
    'static const char jphantom_stub[] = "ROCm runtime stand-in (jphantom.rocm.stubs)";\n'
    "static void jphantom_called(const char *name) {\n"
    '    fprintf(stderr, "jphantom: %s was called, but it is a stand-in for the ROCm runtime '
    "(jphantom.rocm.stubs): this machine has no ROCm, the stand-ins only let XLA's compiler "
    'load; run on a machine with ROCm installed\\n", name);\n'
    "    abort();\n}\n")
_LOADING = re.compile(r"^(__hipRegister|__hipUnregister|rocprofiler_force_configure$)")
_ERROR_TEXT = re.compile(r"(GetErrorString|GetErrorName|StatusString|status_string|"
                         r"ErrorString)$", re.IGNORECASE)
_NOT_CODE = re.compile(r"^_ZT[VIS]")  # C++ vtables and typeinfo: data, never called


def kind_of(name: str) -> str:
    """What a stand-in for ``name`` does (module docstring): ``handle`` (a registration the
    plugin's load makes: a non-null pointer), ``text`` (an error-string getter: readable text),
    ``data`` (a vtable or typeinfo) or ``fail`` (prints ``name`` to stderr and aborts)."""
    if _LOADING.match(name):
        return "handle"
    if _ERROR_TEXT.search(name):
        return "text"
    return "data" if _NOT_CODE.match(name) else "fail"


def _definition(name: str) -> str:
    if kind_of(name) == "fail":
        return f'const void *{name}(void) {{ jphantom_called("{name}"); return 0; }}\n'
    return f"const void *{name}(void) {{ return jphantom_stub; }}\n"


@dataclasses.dataclass(frozen=True)
class Library:
    """One stand-in: its ``soname``, symbols per version node (``""``: unversioned)."""

    soname: str
    symbols: dict[str, tuple[str, ...]]

    def _named(self) -> dict[str, tuple[str, ...]]:
        """Symbols per version; a version node without one gets a placeholder (the loader
        checks that each version the plugin names is defined)."""
        return {v: names or (f"jphantom_version_{i}",)
                for i, (v, names) in enumerate(sorted(self.symbols.items()))}

    def source(self) -> str:
        names = sorted({s for group in self._named().values() for s in group})
        return _STUB_BODY + "".join(_definition(name) for name in names)

    def version_script(self) -> str | None:
        named = self._named()
        nodes = [v for v in named if v]
        if not nodes:
            return None
        return "".join(f"{v} {{ global: {' '.join(n + ';' for n in named[v])} }};\n" for v in sorted(nodes))


def plugin_files() -> list[Path]:
    """The ROCm plugin's native files: the PJRT plugin and the extension modules beside it."""
    import importlib.util

    files = []
    for package in ("jax_plugins", "jax_rocm7_plugin"):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            files += sorted(p for p in Path(root).rglob("*.so")
                            if package != "jax_plugins" or "rocm" in p.parent.name)
    return files


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True,
                          text=True).stdout


def _needed(path: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", str(path)))


def _version_files(path: Path) -> dict[str, str]:
    """version node -> the library file that must define it (``.gnu.version_r``)."""
    out, current = {}, None
    for line in _readelf("-V", str(path)).splitlines():
        if (file := re.search(r"File: (\S+)", line)) is not None:
            current = file[1]
        elif (name := re.search(r"Name: (\S+)\s+Flags", line)) is not None and current:
            out[name[1]] = current
    return out


def _undefined(path: Path) -> list[tuple[str, str]]:
    """(symbol, version or "") the file leaves undefined, weak ones left out."""
    rows = []
    for line in _readelf("--dyn-syms", str(path)).splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[6] == "UND" and cols[4] != "WEAK":
            name, _, version = cols[7].partition("@")
            rows.append((name, version.lstrip("@")))
    return rows


def _loads(soname: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(soname)
    except OSError:
        return None


def needed_libraries(files: list[Path] | None = None) -> list[Library]:
    """The stand-ins the plugin's ``files`` need here: one per needed library that does not load
    (none where ROCm is installed)."""
    files = plugin_files() if files is None else files
    needed = list(dict.fromkeys(n for f in files for n in _needed(f)))
    loaded = {name: _loads(name) for name in needed}
    missing = [n for n in needed if loaded[n] is None]
    if not missing:
        return []
    present = [lib for lib in loaded.values() if lib is not None]
    where = {f: _version_files(f) for f in files}
    versioned = {owner for table in where.values() for owner in table.values()}
    catch_all = next((n for n in missing if n not in versioned), missing[0])
    symbols: dict[str, dict[str, set[str]]] = {n: {} for n in missing}
    for table in where.values():  # every version node asked for, even one with no symbol
        for version, owner in table.items():
            if owner in symbols:
                symbols[owner].setdefault(version, set())
    for file in files:
        for name, version in _undefined(file):
            if version and _SYSTEM_VERSIONS.match(version):
                continue
            owner = where[file].get(version) if version else None
            if owner is None:
                if any(hasattr(lib, name) for lib in present):
                    continue  # defined by a system library the plugin also needs
                owner = catch_all
            if owner in symbols:
                symbols[owner].setdefault(version, set()).add(name)
    return [Library(n, {v: tuple(sorted(s)) for v, s in symbols[n].items()}) for n in missing]


def cache_root() -> Path:
    """Where the stand-ins are cached: ``$JPHANTOM_CACHE_DIR/rocm-stubs``, else
    ``$XDG_CACHE_HOME/jphantom/rocm-stubs`` (default ``~/.cache/jphantom``), as the project's
    other caches (:func:`jphantom.data.tokens.cache_dir`)."""
    root = os.environ.get("JPHANTOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jphantom")
    return Path(root) / "rocm-stubs"


def key_of(libraries: list[Library]) -> str:
    text = "".join(lib.soname + lib.source() + (lib.version_script() or "")
                   for lib in libraries)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(libraries: list[Library], folder: Path) -> list[Path]:
    """Compile each stand-in into ``folder`` (gcc); returns their paths."""
    _require_tools()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for lib in libraries:
        source = folder / f"{lib.soname}.c"
        source.write_text(lib.source())
        command = ["gcc", "-shared", "-fPIC", "-O0", "-o", str(folder / lib.soname),
                   f"-Wl,-soname,{lib.soname}", str(source)]
        if (script := lib.version_script()) is not None:
            (folder / f"{lib.soname}.map").write_text(script)
            command.append(f"-Wl,--version-script,{folder / f'{lib.soname}.map'}")
        subprocess.run(command, check=True, capture_output=True)
        paths.append(folder / lib.soname)
    return paths


def _require_tools() -> None:
    if shutil.which("gcc") is None or shutil.which("readelf") is None:
        raise ConfigError("compiling for ROCm without ROCm needs gcc and readelf (binutils) to "
                          "build stand-ins for its runtime libraries: install them (apt install "
                          "gcc binutils) or install ROCm")


def ensure() -> list[Path]:
    """Build (once, cached) and load the stand-ins this machine needs; returns their paths
    (empty where every ROCm library loads)."""
    _require_tools()
    libraries = needed_libraries()
    if not libraries:
        return []
    folder = cache_root() / key_of(libraries)
    paths = [folder / lib.soname for lib in libraries]
    if not all(p.is_file() for p in paths):
        scratch = folder.with_name(folder.name + f".tmp{os.getpid()}")
        build(libraries, scratch)
        if folder.exists():
            shutil.rmtree(scratch)
        else:
            scratch.rename(folder)
    for path in paths:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return paths


__all__ = ["Library", "build", "cache_root", "ensure", "key_of", "kind_of", "needed_libraries",
           "plugin_files"]
