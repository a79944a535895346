"""datasets.TitleIds: every block's title as a 64-bit id, checked against the strings by hand:
equal titles equal ids, each title's first block, the count of blocks sharing a title; and
the gathered form (_gather_title_ids) from per-range lists, as processes hold them."""

import numpy as np
import pytest

from realm_jax.data import datasets

TITLES = ["Paris", "Rome", "Paris", "Oslo", "Rome", "Paris"]


def test_ids_first_blocks_and_counts_against_the_strings():
    t = datasets.TitleIds.of(TITLES)
    same = t.ids[:, None] == t.ids[None, :]
    want = np.asarray([[a == b for b in TITLES] for a in TITLES])
    np.testing.assert_array_equal(same, want)
    assert [t.get(x) for x in ("Paris", "Rome", "Oslo", "Bern")] == [0, 1, 3, -1]
    np.testing.assert_array_equal(t.count, [3, 2, 3, 1, 2, 3])
    assert t.ids.dtype == np.int64 and len(t) == 6
    assert datasets.title_hash("Paris") == datasets.title_hash("Paris")
    assert t.name(2) == "?"  # no data_dir to read the title back from


def test_gathered_from_ranges_as_processes_hold_them():
    local = {(0, 2): TITLES[0:2], (2, 5): TITLES[2:5], (5, 8): TITLES[5:]}  # 8: padding
    got = datasets._gather_title_ids(local, len(TITLES))
    np.testing.assert_array_equal(got, datasets.TitleIds.of(TITLES).ids)
    with pytest.raises(RuntimeError, match="held by no process"):
        datasets._gather_title_ids({(0, 2): TITLES[0:2]}, len(TITLES))
