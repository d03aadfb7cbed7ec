"""The update benchmark on a CPU: the disk rows are measured, and the optional loader's row
says why it was not measured instead of showing a number."""
from course_lib.bench import update


def test_disk_rows_are_measured_and_instanttensor_says_why_not(capsys):
    res = update.main(["--preset", "tiny", "--device", "cpu", "--parts", "disk", "instanttensor",
                       "--no-transformers"])
    out = capsys.readouterr().out
    assert res["disk_layer"]["gbps"] > 0 and res["disk_full"]["gbps"] > 0
    assert set(res["instanttensor"]) == {"skipped"}  # no CUDA here (nor, usually, the package)
    assert "InstantTensor: not measured (" in out and "InstantTensor safe_open" not in out
