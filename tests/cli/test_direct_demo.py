"""``kvmove demo --processes N --direct``: a prefill process streams pages layer by layer
straight into the decode processes' layer-first pools, which check every byte (and that
nothing else was written); bad option combinations are one line, exit 2; the decode
side's check fails on a wrong byte, a written padding row or a stray page."""

from __future__ import annotations

import pytest

from kvmove.cli import command as cli
from kvmove.cli import demo_options
from kvmove.cli.direct_node import SENTINEL, DecodeSide


def test_direct_demo_streams_into_the_decode_pool_and_verifies(capsys, monkeypatch):
    # The command as the user types it, run in this process (its two node processes are
    # processes of their own). 70 pages: two prefill requests; 2-token pages: the last
    # page is partial (1 token).
    monkeypatch.setenv("COLUMNS", "160")
    code = cli.main(["demo", "--processes", "2", "--direct", "--pages", "70",
                     "--page-tokens", "2", "--layers", "3", "--indexer-layers", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verified: 70 pages streamed layer by layer" in out
    assert "into 1 decode pool(s)" in out
    assert "ok 210" in out  # 70 pages x 3 layers


@pytest.mark.parametrize(("args", "option"), [
    (["--direct"], "--direct"),
    (["--direct", "--processes", "2", "--master", "127.0.0.1:5"], "--master"),
    (["--direct", "--processes", "2", "--replicas", "2"], "--replicas"),
])
def test_bad_direct_combinations_are_one_line_exit_2(args, option, capsys):
    parsed, _, subparser = cli.parse(["demo", *args])
    with pytest.raises(SystemExit) as exit_:
        demo_options.check(subparser, parsed)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], lines


def test_the_decode_check_fails_on_wrong_or_stray_bytes():
    from kvmove.cli.synthetic_pages import page_bytes

    side = DecodeSide(layers=2, indexer_layers=1, page_tokens=4, pages=6)
    try:
        pool = side.pool_tensors
        for page, dst, valid in ((10, 1, 4), (11, 2, 3)):
            for name, t in pool.items():
                want = page_bytes(page, name, t.shape[0], 4, t.shape[2])
                t[:, dst * 4:dst * 4 + valid] = want[:, :valid]
        check = {"pages": [10, 11], "dst": [1, 2], "valid": [4, 3]}
        assert side.verify(**check) == {"wrong": [], "touched": [],
                                        "bytes": 2 * 4 * 656 + 4 * 132 + 2 * 3 * 656 + 3 * 132}
        pool["kv"][1, 1 * 4 + 2, 7] ^= 0xFF  # a wrong byte in page 10
        pool["indexer"][0, 2 * 4 + 3, 0] = SENTINEL ^ 1  # page 11's padding row written
        pool["kv"][0, 5 * 4, 0] = 0  # a page no send names
        result = side.verify(**check)
        assert result["wrong"] == [10] and result["touched"] == [11, "pool page 5"]
    finally:
        side.close()
