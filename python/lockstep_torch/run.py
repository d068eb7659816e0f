"""python3 -m lockstep_torch.run: torchrun (torch.distributed.run), with the one fix that makes it
start under Python 3.11 with torch 1.13 (Debian bookworm's python3-torch).

    /usr/bin/python3 -m lockstep_torch.run --standalone --nproc_per_node 4 train.py [train.py's options]

Every option is torchrun's; this module changes nothing else and is a plain call of torchrun's
main() wherever torchrun works by itself (torch >= 2.0, or Python <= 3.10).

Why torchrun fails there. torchrun parses --redirects and --tee (both "0" by default) with
torch.distributed.elastic.multiprocessing.api.Std.from_str, which finds the member by iterating the
IntFlag `Std` (NONE = 0, OUT = 1, ERR = 2, ALL = 3) and returns None when none matches. Since
Python 3.11 iterating a Flag yields only its canonical one-bit members: 0-valued and multi-bit
members count as aliases and are skipped (python/cpython#98976, "by design"). So "0" and "3" parse
to None, and torchrun's to_map() later calls None.get(...):
    AttributeError: 'NoneType' object has no attribute 'get'
before any worker starts. torch 1.13 predates Python 3.11 support; PyTorch fixed from_str for 2.0
(the Python 3.11 work tracked in pytorch/pytorch#92319). The fix here replaces from_str, only when
it is broken, by one that converts with Std(int(value)) and accepts exactly the same strings.
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import api as _api


def _from_str(cls, vm):
    """Std.from_str as torch documents it: "0".."3" -> Std; "0:3,1:0" -> {local rank: Std}."""
    if re.match(_api._VALUE_REGEX, vm):
        return cls(int(vm))
    if re.match(_api._MAPPING_REGEX, vm):
        return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{_api._VALUE_REGEX}> or <{_api._MAPPING_REGEX}>")


def from_str_is_broken():
    """True where torch's Std.from_str loses the 0-valued or multi-bit members (Python 3.11+)."""
    Std = _api.Std
    try:
        return Std.from_str("0") is not Std.NONE or Std.from_str("3") is not Std.ALL
    except Exception:
        return True


def patch():
    """Replaces Std.from_str where it is broken; returns whether it did."""
    if not from_str_is_broken():
        return False
    _api.Std.from_str = classmethod(_from_str)
    return True


def main(args=None):
    patch()
    from torch.distributed.run import main as torchrun_main
    return torchrun_main(args)


if __name__ == "__main__":
    sys.exit(main())
