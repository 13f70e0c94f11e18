"""Sizes and rates as users write them, and sizes printed back (mcallreduce/units.py)."""
import pytest

from mcallreduce.errors import ConfigError
from mcallreduce.units import format_bytes, format_size, parse_rate, parse_size, parse_sizes


@pytest.mark.parametrize("n", [1, 1000, 4096, 65536, 65537, 3 << 20, 256 << 20, 1 << 30])
def test_format_size_reads_back_exactly(n):
    assert parse_size(format_size(n)) == n


def test_format_size_uses_the_largest_exact_unit():
    assert [format_size(n) for n in (65536, 1536 << 10, 2 << 30, 61440)] == ["64K", "1536K", "2G", "60K"]


def test_format_bytes_rounds_for_people():
    assert [format_bytes(n) for n in (512, 1536, 1153433, 5 << 40)] == ["512 B", "1.5 KiB", "1.1 MiB", "5.0 TiB"]


def test_rates_are_tc_units():
    assert parse_rate("200mbit") == 200_000_000 and parse_rate("10gbit") == 10_000_000_000
    assert parse_rate("1mbps") == 8_000_000   # bytes per second, as tc reads "bps"
    with pytest.raises(ConfigError, match="bad rate"):
        parse_rate("fast")


def test_size_lists_are_the_command_lines_form():
    assert parse_sizes("4K,1M,") == [4096, 1 << 20]
    with pytest.raises(ConfigError, match="--sizes"):
        parse_sizes("4K,lots", "--sizes")
