"""The ground floor's units: the sizes every document and log line prints, as they were
printed before they were said once (issue 41)."""

from sidecar.units import GIB, MIB, format_bytes, gib, gib_or_mib


def test_sizes_print_as_the_documents_always_printed_them() -> None:
    assert gib(3 * GIB) == "3.0 GiB" and gib(GIB // 2, 2) == "0.50 GiB"
    assert gib_or_mib(GIB) == "1.0 GiB" and gib_or_mib(GIB - MIB) == "1023 MiB"
    assert gib_or_mib(-2 * GIB) == "-2.0 GiB" and gib_or_mib(-52 * MIB) == "-52 MiB"  # a rate down
    assert gib_or_mib(3 * GIB + GIB // 4, 2) == "3.25 GiB"
    assert format_bytes(1536 * MIB) == "1.5 GiB" and format_bytes(12 * 1024) == "12.0 KiB"
    assert format_bytes(512) == "512 B" and format_bytes(0) == "0 B"
