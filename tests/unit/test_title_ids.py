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


def test_an_updated_versions_positions_by_hand():
    """An example's block ids (prepared rows) read as positions of a corpus version that
    serves rows [0, 1, 3, 5, 6] of 7 (rows 2 and 4 deleted or replaced): what pre-training on
    an updated workdir retrieves around (pipeline.to_positions, gold_block)."""
    from realm_jax.data import pipeline, versions

    view = versions.View.__new__(versions.View)
    view.manifest, view.num_rows = {"segments": []}, 7
    view.rows = np.asarray([0, 1, 3, 5, 6], np.int64)
    pos = view.positions()
    np.testing.assert_array_equal(pos, [0, 1, -1, 2, -1, 3, 4])
    out = {
        "block_id": np.int32(3),
        "extra_ids": np.asarray([5, -1, 2, 6], np.int32),
        "article_block": np.int32(4),
        "query_ids": np.asarray([3, 5], np.int32),  # not a block: left as it is
    }
    got = pipeline.to_positions(out, pos)
    assert int(got["block_id"]) == 2 and int(got["article_block"]) == -1
    np.testing.assert_array_equal(got["extra_ids"], [3, -1, -1, 4])
    np.testing.assert_array_equal(got["query_ids"], [3, 5])
    assert got["extra_ids"].dtype == np.int32 and int(out["block_id"]) == 3  # a copy
    # the own block when served, else the first block of the title (positions already)
    gold_of = datasets.TitleIds.of(["Paris", "Rome", "Oslo", "Rome", "Bern"])
    assert pipeline.gold_block({"block_id": 5, "title": b"Oslo"}, gold_of, pos) == 3
    assert pipeline.gold_block({"block_id": 4, "title": b"Rome"}, gold_of, pos) == 1
    assert pipeline.gold_block({"block_id": 2, "title": b"Nowhere"}, gold_of, pos) == -1
    assert pipeline.gold_block({"block_id": 4, "title": b"Rome"}, gold_of) == 4  # no version
