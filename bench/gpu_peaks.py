"""Data-sheet peaks of common GPUs, for the benchmarks' share-of-peak figures."""

from __future__ import annotations

# dense HBM bandwidth (GB/s) and dense bf16 tensor-core TFLOP/s
PEAKS = {
    "H100 80GB HBM3": (3350.0, 989.0),  # SXM
    "H100 PCIe": (2000.0, 756.0),
    "H100 NVL": (3900.0, 835.0),
    "H200": (4800.0, 989.0),
    "A100-SXM4-80GB": (2039.0, 312.0),
    "A100-SXM4-40GB": (1555.0, 312.0),
}


def device_peaks(name: str) -> tuple[float, float] | None:
    """(GB/s, TFLOP/s) for a known device name, else None."""
    for key, peaks in PEAKS.items():
        if key in name:
            return peaks
    return None
