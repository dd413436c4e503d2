"""Bytes as printed: binary units, three significant digits, the unit always written."""

import math

import pytest

from autoshard.ir.units import format_bytes


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (107, "107 B"),
        (3168, "3.09 KiB"),
        (1.25 * 2**20, "1.25 MiB"),
        (16 * 2**30, "16 GiB"),
        (1_035_000, "1011 KiB"),  # 1,000-1,023 of a unit: never "1.01e+03 KiB"
        (1023.9 * 2**20, "1024 MiB"),
        (999.4 * 2**10, "999 KiB"),
        (2**20, "1 MiB"),
    ],
)
def test_format_bytes_reads_as_people_read_it(nbytes, text):
    assert format_bytes(nbytes) == text
    assert "e+" not in format_bytes(nbytes, exact=True)


def test_format_bytes_signs_and_exact_counts():
    assert format_bytes(3168, exact=True) == "3.09 KiB (3,168 B)"
    assert format_bytes(-1_035_000, signed=True) == "-1011 KiB"
    assert format_bytes(2048, signed=True) == "+2 KiB"
    assert format_bytes(math.inf) == "inf B"
