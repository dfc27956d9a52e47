"""An ltcx command keeps the memory a step frees for the next step (``ltcx/cli/allocator.py``): on glibc, a block under
32 MiB comes from the heap, and freeing it gives no memory back to the system (to be zero-filled again at the next
step's first touch). Each case runs in a fresh interpreter, since malloc's settings are the process's."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT

GLIBC = hasattr(os, "confstr") and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")

PROBE = """
import torch
{setup}
def mapping(address):  # the name of the /proc/self/maps line holding address ('' for an anonymous mapping)
    for line in open("/proc/self/maps"):
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 else ""
def resident_mib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
blocks = [torch.ones(4 << 20) for _ in range(3)]  # 3 x 16 MiB written, as a step writes its activations
where = mapping(blocks[0].data_ptr())
before = resident_mib()
del blocks
print(f"{where}|{before - resident_mib()}")
"""


def probe(setup: str, **env) -> tuple[str, int]:
    """(the mapping a fresh 16 MiB tensor lies in, MiB of resident memory given back when three of them are freed)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    result = subprocess.run([sys.executable, "-c", PROBE.replace("{setup}", setup)], capture_output=True, text=True,
                            cwd=ROOT, env={**environment, **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    where, returned = result.stdout.strip().splitlines()[-1].split("|")
    return where, int(returned)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_command_keeps_freed_memory_for_the_next_step():
    # through the command line's entry point (an unknown command: it sets malloc before anything else, then exits 2)
    command = "from ltcx.cli import main\ntry:\n    main(['no-such-command'])\nexcept SystemExit:\n    pass"
    where, returned = probe(command)
    assert where == "[heap]"  # not a mapping of its own, unmapped when freed
    assert returned < 8  # of the 48 MiB freed: kept for the next step, not given back to be zero-filled again


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_users_own_malloc_settings_are_kept():
    setup = "from ltcx.cli.allocator import keep_freed_memory\nassert not keep_freed_memory()"
    where, returned = probe(setup, MALLOC_MMAP_THRESHOLD_="131072")  # the user's: blocks over 128 KiB mapped alone
    assert where != "[heap]" and returned >= 40
