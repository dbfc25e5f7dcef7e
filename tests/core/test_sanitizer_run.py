"""The sanitizer driver's case selection and log reading (the run itself needs a GPU)."""
import itertools

from tests.sanitizer_run import (FAMILIES, cover, one_each, pytest_counts, shards,
                                  summary_errors)


def test_cover_uses_every_parameter_value_with_fewer_cases():
    ids = [f"t.py::test_a[{d}-{w}-{n}]" for d, w, n in
           itertools.product(["float32", "float64"], ["int32", "int64"], ["1", "7", "1000"])]
    ids += ["t.py::test_b", "t.py::test_c[bad]", "t.py::test_c[good]"]
    kept = cover(ids)
    assert len(kept) < len(ids)
    for function, values in [("test_a", {"float32", "float64", "int32", "int64", "1", "7",
                                          "1000"}),
                             ("test_c", {"bad", "good"})]:
        used = set()
        for case in kept:
            if f"::{function}[" in case:
                used |= set(case.partition("[")[2].rstrip("]").split("-"))
        assert used == values
    assert "t.py::test_b" in kept
    assert len(kept) == len(set(kept))
    # values count per position: [1-3] and [3-1] do not make [1-1] and [3-3] redundant
    swapped = [f"t.py::test_d[{a}-{b}]" for a, b in ((1, 3), (3, 1), (1, 1), (3, 3))]
    kept = cover(swapped)
    assert {c[-4] for c in kept} == {"1", "3"} and {c[-2] for c in kept} == {"1", "3"}


def test_shards_deal_every_case_once():
    ids = [f"t.py::test[{k}]" for k in range(10)]
    dealt = shards(ids, 3)
    assert len(dealt) == 3 and sorted(sum(dealt, [])) == sorted(ids)
    assert shards(ids[:2], 5) == [[ids[0]], [ids[1]]]


def test_log_reading():
    assert summary_errors("========= ERROR SUMMARY: 0 errors\n") == 0
    assert summary_errors("========= ERROR SUMMARY: 2 errors\n=== ERROR SUMMARY: 1 error") == 3
    assert summary_errors("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, "
                          "0 warnings)") == 1
    assert summary_errors("Segmentation fault") is None
    assert pytest_counts("....\n12 passed, 1 skipped, 2 failed in 3.1s") == (12, 1, 2)
    assert pytest_counts("1 passed, 1 error in 0.2s") == (1, 0, 1)


def test_families_name_existing_files():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    for files in FAMILIES.values():
        for name in files:
            assert (root / name).is_file(), name


def test_one_each_keeps_each_functions_first_case():
    ids = ["t.py::test_a[1]", "t.py::test_a[2]", "t.py::test_b", "u.py::test_a[1]"]
    assert one_each(ids) == ["t.py::test_a[1]", "t.py::test_b", "u.py::test_a[1]"]
