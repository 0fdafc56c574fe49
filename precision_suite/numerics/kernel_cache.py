"""Where inductor caches the compiled quantizer kernels: one folder per compile environment.

Inductor's on-disk caches key a graph on its code, input shapes and inductor settings, not on
the CPU's vector ISA: kernels cached by default-settings runs (AVX-512 here) and then served to a
process whose torch ran with ATEN_CPU_CAPABILITY=avx2 trained gpt-softmax-fp8-block to a NaN loss
at step 0 (14.7 million non-finite elements; 5.5719 with an empty cache). So everything the
generated and compiled code depends on names a subfolder, and a key file beside it says what:
a folder whose key file is missing or says otherwise is never used. Inductor's own caches work
inside the folder as before; this module only chooses it.

Computed without importing torch (it runs at `import precision_suite`, before any inductor code):
the capability torch uses (torch.backends.cpu.get_cpu_capability()) follows from the torch build,
the CPU's flags and ATEN_CPU_CAPABILITY, all three in the key.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
from pathlib import Path

# Environment variables that change the code inductor generates, beside $CXX (in the compiler's
# identity) and its own TORCHINDUCTOR_* settings (part of its cache keys already).
CODE_SETTINGS = ("ATEN_CPU_CAPABILITY",)
KEY_LENGTH = 16  # hex digits of the folder name
MAX_FOLDERS_PER_KEY = 100  # folders tried for one key before giving up on the cache


def compile_environment() -> dict[str, str]:
    """What compiled kernels depend on, as JSON-ready strings: Python, torch, the CPU (model and
    a hash of its feature flags), the C++ compiler inductor calls, and CODE_SETTINGS."""
    model, flags = _cpu_model_and_flags()
    return {
        "python": sys.version,
        "torch": _torch_version(),
        "machine": platform.machine(),
        "cpu_model": model,
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:KEY_LENGTH],
        "compiler": _compiler_identity(),
        **{name: os.environ.get(name, "") for name in CODE_SETTINGS},
    }


def keyed_cache_dir(root: str | Path, environment: dict[str, str]) -> Path:
    """The folder under `root` for kernels compiled in `environment`: `<hash>` (or `<hash>-N`),
    claimed by writing `<folder>.json` (the environment) before the folder is made."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    key = json.dumps(environment, sort_keys=True, indent=1) + "\n"
    digest = hashlib.sha256(key.encode()).hexdigest()[:KEY_LENGTH]
    for attempt in range(MAX_FOLDERS_PER_KEY):
        folder = root / (digest if attempt == 0 else f"{digest}-{attempt}")
        key_file = folder.with_name(folder.name + ".json")
        if not key_file.exists():
            if folder.exists():  # made without a key file: it cannot prove what it holds
                continue
            try:  # exclusive create: of two processes claiming one folder, one writes it
                with open(key_file, "x", encoding="utf-8") as claim:
                    claim.write(key)
            except FileExistsError:
                pass
        # a differing key (or one read while another process writes it) is not this folder's
        if key_file.read_text(encoding="utf-8") != key:
            continue
        folder.mkdir(exist_ok=True)
        return folder
    raise OSError(f"{root}: {MAX_FOLDERS_PER_KEY} kernel folders of key {digest} do not fit; clear the cache")


def _cpu_model_and_flags() -> tuple[str, str]:
    """The first CPU's model name and feature flags from /proc/cpuinfo (Linux); elsewhere the
    processor name Python reports, for both."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:  # the first processor's block holds both; stop there
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "Processor", "CPU part") and not model:
                    model = value.strip()
                elif name in ("flags", "Features"):
                    flags = value.strip()
                    break
    except OSError:
        model = flags = platform.processor()
    return model, flags


def _torch_version() -> str:
    """torch's version and git commit from its version.py, read without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "absent"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    except OSError:
        return f"unknown at {spec.origin}"
    return " ".join(re.findall(r"^(?:__version__|git_version)\s*=\s*'([^']*)'", text, re.M))


def _compiler_identity() -> str:
    """The C++ compiler inductor calls on CPU ($CXX, else g++; clang++ on macOS): its resolved
    path, size and modification time, which change with the compiler (no subprocess at import)."""
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    found = shutil.which(name)
    if found is None:
        return f"{name} (not found)"
    path = os.path.realpath(found)
    stat = os.stat(path)
    return f"{path} {stat.st_size} {stat.st_mtime_ns}"
