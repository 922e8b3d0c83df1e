"""Compile _cbody.c in place, twice: ``_cbody.abi3.so`` (Py_LIMITED_API
3.9: one binary for every CPython >= 3.9) and ``_cbody_full<EXT_SUFFIX>``
(this interpreter's full API). A direct compiler call with sysconfig's flags.

    python benchmarks/cbody/build.py
"""

import os
import shlex
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "_cbody.c")
BUILDS = {  # module name -> (file name, extra defines)
    "_cbody": ("_cbody.abi3.so", ["-DPy_LIMITED_API=0x03090000"]),
    "_cbody_full": ("_cbody_full" + sysconfig.get_config_var("EXT_SUFFIX"), []),
}


def command(name, target, defines):
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    flags = shlex.split(sysconfig.get_config_var("CCSHARED") or "-fPIC")
    return [
        *cc,
        *flags,
        "-O2",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-Wno-missing-field-initializers",
        "-Wno-cast-function-type",
        f"-I{sysconfig.get_paths()['include']}",
        f"-DMODULE_ID={name}",
        *defines,
        SOURCE,
        "-shared",  # no libpython: the interpreter provides the symbols
        "-o",
        os.path.join(HERE, target),
    ]


def main():
    for name, (target, defines) in BUILDS.items():
        cmd = command(name, target, defines)
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"built {target} in {time.perf_counter() - start:.2f} s: {' '.join(cmd[:1])} ... {' '.join(defines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
