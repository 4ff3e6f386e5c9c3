"""The tool seam (cxlkv.host.tools): PATH lookup, timeouts, exit status and stderr,
JSON of every shape - all on output captured from real tools in a QEMU guest
(tests/fixtures/lab/commands), never on invented output."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cxlkv import errors
from cxlkv.host import tools
from cxlkv.testing.replay import MUTATIONS, STATES, ReplayRunner

LAB = Path(__file__).resolve().parent / "fixtures" / "lab"


def rec(state: str, name: str) -> dict:
    return json.loads((LAB / "commands" / state / f"{name}.json").read_text())


def fake_tool(bindir: Path, tool: str, record: dict, *, sleep: float = 0) -> None:
    """An executable `tool` on a private PATH that prints a captured record verbatim."""
    bindir.mkdir(exist_ok=True)
    (bindir / f"{tool}.out").write_text(record["stdout"])
    (bindir / f"{tool}.err").write_text(record["stderr"])
    script = bindir / tool
    script.write_text("#!/bin/sh\n" + (f"sleep {sleep}\n" if sleep else "")
                      + f'cat "{bindir}/{tool}.out"; cat "{bindir}/{tool}.err" >&2; '
                      f'exit {record["rc"]}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


# -- parsing every shape the tools print --------------------------------------

def test_parse_json_shapes_from_real_output():
    # array (the default)
    assert isinstance(tools.parse_json(rec("raw", "cxl-list-M")["stdout"]), list)
    # a bare object: cxl list with one result and -u (captured; cxlkv never passes -u)
    assert isinstance(tools.parse_json(rec("region", "cxl-list-R-u")["stdout"]), dict)
    # "no match": cxl prints "[\n]" and a warning on stderr, exit 0
    r = rec("raw", "cxl-list-R")
    assert r["stdout"].strip() == "[\n]".strip() and r["rc"] == 0 and "no matching" in r["stderr"]
    assert tools.parse_json(r["stdout"]) == []
    # ndctl / daxctl print nothing at all when there is nothing to list
    assert rec("raw", "ndctl-list-R")["stdout"] == ""
    assert tools.parse_json(rec("raw", "daxctl-list-D-R-M-i")["stdout"]) == []
    with pytest.raises(ValueError):
        tools.parse_json(rec("devdax", "ls-dev-dax")["stdout"])


def test_flatten_cxl_every_shape():
    # nested topology (cxl list -vvv): every object once, with its parent
    flat = tools.flatten_cxl(tools.parse_json(rec("devdax", "cxl-list-vvv")["stdout"]))
    assert [b["bus"] for b in flat["bus"]] == ["root0"]
    assert [(p["port"], p["parent"]) for p in flat["port"]] == [("port1", "root0")]
    assert [(m["memdev"], m["parent"]) for m in flat["memdev"]] == [("mem0", "endpoint2")]
    assert {d["decoder"]: d["parent"] for d in flat["decoder"]} == {
        "decoder0.0": "root0", "decoder1.0": "port1", "decoder2.0": "endpoint2"}
    (region,) = flat["region"]
    assert region["region"] == "region0" and region["parent"] == "decoder0.0"
    assert region["decode_state"] == "commit" and region["size"] == 256 << 20
    # children are taken out of their parents; references ("mappings") stay
    assert "regions:decoder0.0" not in flat["decoder"][-1]
    assert region["mappings"] == [{"position": 0, "memdev": "mem0", "decoder": "decoder2.0"}]
    # array of named arrays (several object types without a common parent)
    flat = tools.flatten_cxl(tools.parse_json(rec("raw", "cxl-list-M-D-P-E-T-u")["stdout"]))
    assert [d["decoder"] for d in flat["decoder"]] == ["decoder0.0"]
    assert [m["memdev"] for m in flat["memdev"]] == ["mem0"]
    assert [e["endpoint"] for e in flat["endpoint"]] == ["endpoint2"]
    # a bare object
    assert [r["region"] for r in tools.flatten_cxl(
        tools.parse_json(rec("region", "cxl-list-R-u")["stdout"]))["region"]] == ["region0"]
    # flat single-type lists
    assert [m["memdev"] for m in tools.flatten_cxl(
        tools.parse_json(rec("raw", "cxl-list-M")["stdout"]))["memdev"]] == ["mem0"]
    assert tools.flatten_cxl([]) == {k: [] for k in ("region", "decoder", "endpoint", "port", "bus",
                                                  "memdev")}


def test_flatten_dax_and_nd():
    regions, devices = tools.flatten_dax(tools.parse_json(rec("devdax",
                                                              "daxctl-list-D-R-M-i")["stdout"]))
    assert [r["id"] for r in regions] == [0]
    (dev,) = devices
    assert (dev["chardev"], dev["mode"], dev["align"], dev["target_node"], dev["region_id"]) == \
        ("dax0.0", "devdax", 2 << 20, 1, 0)
    # devices alone (-D): a flat array of devices
    assert [d["chardev"] for d in tools.flatten_dax(
        tools.parse_json(rec("devdax", "daxctl-list-D")["stdout"]))[1]] == ["dax0.0"]
    _, devices = tools.flatten_dax(tools.parse_json(rec("system-ram",
                                                        "daxctl-list-D-R-M-i")["stdout"]))
    assert devices[0]["mode"] == "system-ram" and devices[0]["online_memblocks"] == 1
    buses, regions, nss = tools.flatten_nd(tools.parse_json(rec("devdax",
                                                                "ndctl-list-vvv")["stdout"]))
    assert [b["dev"] for b in buses] == ["ndbus0"]
    assert [(r["dev"], r["type"], r["bus"]) for r in regions] == [("region0", "pmem", "ndbus0")]
    assert {n["dev"]: n["mode"] for n in nss} == {"namespace0.0": "devdax", "namespace0.1": "raw"}


# -- the runner: PATH, exit status, stderr, timeout ------------------------------

def test_runner_finds_tools_on_path_and_parses(tmp_path):
    fake_tool(tmp_path / "bin", "cxl", rec("devdax", "cxl-list-vvv"))
    r = tools.Runner(path=str(tmp_path / "bin"))
    doc = r.json(["cxl", "list", "-vvv"])
    assert tools.flatten_cxl(doc)["region"][0]["region"] == "region0"
    assert r.log[-1].argv == ["cxl", "list", "-vvv"] and r.log[-1].rc == 0


def test_runner_tool_missing(tmp_path):
    r = tools.Runner(path=str(tmp_path))
    assert not r.available("daxctl")
    with pytest.raises(tools.ToolNotFound) as ei:
        r.run(["daxctl", "list"])
    assert ei.value.exit_code == errors.EXIT_NOT_FOUND
    assert "apt-get install daxctl" in ei.value.hint
    assert isinstance(ei.value, errors.CxlkvError)


def test_runner_carries_exit_status_and_stderr(tmp_path):
    # a real failure: ndctl create-namespace with no space left (rc 237)
    failure = rec("devdax", "err-create-namespace-no-space")
    assert failure["rc"] == 237
    fake_tool(tmp_path / "bin", "ndctl", failure)
    r = tools.Runner(path=str(tmp_path / "bin"))
    with pytest.raises(tools.ToolFailed) as ei:
        r.run(failure["argv"])
    e = ei.value
    assert e.exit_code == errors.EXIT_DEVICE and e.kind == "tool-failed"
    assert e.result.rc == 237 and "No space left on device" in e.result.stderr
    assert "exit status 237" in e.message and "No space left on device" in e.message
    assert e.to_json()["tool"]["rc"] == 237
    # check=False hands the result back instead
    assert r.run(failure["argv"], check=False).rc == 237


def test_runner_exit_code_that_lies_is_not_an_error(tmp_path):
    """ndctl 76.1: destroy-region of a missing region exits 0, 'destroyed 0 regions'."""
    lie = rec("raw", "err-destroy-region-missing")
    fake_tool(tmp_path / "bin", "cxl", lie)
    res = tools.Runner(path=str(tmp_path / "bin")).run(lie["argv"])
    assert res.rc == 0 and "destroyed 0 regions" in res.stderr   # callers verify by listing


def test_runner_usage_error_of_a_tool(tmp_path):
    # daxctl has no -v: usage error, rc 129, nothing on stdout
    bad = rec("raw", "daxctl-list-vvv")
    fake_tool(tmp_path / "bin", "daxctl", bad)
    with pytest.raises(tools.ToolFailed) as ei:
        tools.Runner(path=str(tmp_path / "bin")).json(bad["argv"])
    assert ei.value.result.rc == 129 and "unknown switch" in ei.value.message


def test_runner_output_that_is_not_json(tmp_path):
    fake_tool(tmp_path / "bin", "cxl", rec("devdax", "ls-dev-dax"))
    with pytest.raises(tools.ToolOutputError) as ei:
        tools.Runner(path=str(tmp_path / "bin")).json(["cxl", "list"])
    assert ei.value.kind == "tool-output" and "not JSON" in ei.value.message


def test_runner_timeout(tmp_path):
    fake_tool(tmp_path / "bin", "cxl", rec("raw", "cxl-list-M"), sleep=30)
    r = tools.Runner(path=str(tmp_path / "bin"), timeout=0.3)
    with pytest.raises(tools.ToolTimeout) as ei:
        r.run(["cxl", "list", "-M"])
    assert "no answer after 0.3 s" in ei.value.message
    assert ei.value.exit_code == errors.EXIT_DEVICE


def test_runner_never_passes_human(tmp_path):
    with pytest.raises(ValueError):
        tools.Runner(path=str(tmp_path)).run(["cxl", "list", "-M", "-u"])
    with pytest.raises(ValueError):
        tools.Runner(path=str(tmp_path)).run(["daxctl", "list", "--human"])


def test_use_runner_is_the_one_seam(tmp_path):
    r = ReplayRunner(LAB, "raw")
    with tools.use_runner(r):
        assert tools.runner() is r
    assert tools.runner() is not r


# -- the fixtures themselves -----------------------------------------------------

def test_fixtures_have_what_replay_needs():
    """Every state has the discovery listings; every mutation has its captured record."""
    from cxlkv.host.discovery import CXL_LIST, DAXCTL_LIST, NDCTL_LIST

    for st in STATES:
        r = ReplayRunner(LAB, st)
        for argv in (CXL_LIST, NDCTL_LIST, DAXCTL_LIST):
            assert r.find(st, argv) is not None, (st, argv)
        assert (LAB / "sysfs" / st / "sys").is_dir()
    for argv, (st, name, _) in MUTATIONS.items():
        assert rec(st, name)["argv"] == list(argv)
    meta = json.loads((LAB / "meta.json").read_text())
    assert meta["tools"]["cxl"] == "76.1" and meta["kernel_version"].startswith("6.1.")
    assert os.path.exists(LAB / "README.md")
