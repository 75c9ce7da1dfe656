"""fourbit.cpuinfo: the one reader of /proc/cpuinfo."""

from __future__ import annotations

import pytest

from fourbit.cpuinfo import first_processor, isa_flags, vendor

TWO_PROCESSORS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon: 2.0GHz\nflags\t\t: fpu avx2\n"
    "\nprocessor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f\n"
)


def test_fields_come_from_the_first_processor():
    fields = first_processor(TWO_PROCESSORS)
    assert fields["model name"] == "Xeon: 2.0GHz"  # only the first ':' separates
    assert isa_flags(TWO_PROCESSORS) == {"fpu", "avx2"}
    assert vendor(TWO_PROCESSORS) == "GenuineIntel"


def test_arm_features_and_no_vendor():
    text = "processor\t: 0\nFeatures\t: fp asimd sve\n"
    assert isa_flags(text) == {"fp", "asimd", "sve"}
    assert vendor(text) is None


def test_no_flags_is_named():
    with pytest.raises(ValueError, match="the text given has no 'flags' or 'Features' line"):
        isa_flags("processor\t: 0\n")


def test_this_host_parses():
    assert "avx2" in isa_flags() or "asimd" in isa_flags()  # any host these tests run on
    assert vendor() in ("GenuineIntel", "AuthenticAMD", None)
