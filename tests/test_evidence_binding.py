"""Evidence bound to what was measured: weights replaced under the same path, and a criterion's
workload. Reference servers on loopback; status, phases, report and their exit codes agree."""

from __future__ import annotations

import copy
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from kdctl.evidence import EvidenceFile
from kdctl.records import content_hash
from tests.conftest import (
    REPO,
    Served,
    engine_pair,
    kdctl,
    need_module,
    serve_reference,
    warm_argv,
    write_inventory,
)

need_module("torch", "reference")

ROADMAP = {
    "title": "Binding test",
    "serving": "baseline",
    "candidate": "candidate",
    "phases": [
        {
            "id": "exact",
            "title": "Greedy-exact",
            "criteria": [
                {
                    "gate": "exactness",
                    "settings": {"mode": "strict"},
                    "require": {"match_rate": ">= 1.0"},
                }
            ],
        },
        {
            "id": "cutover",
            "title": "Cutover",
            "depends_on": ["exact"],
            "criteria": [{"name": "soak", "gate": "sign-off"}],
        },
    ],
}


def _inventory(tmp: Path, baseline_url: str, candidate_url: str) -> Path:
    """The binding roadmap over a baseline and a candidate, exactness of eight tokens."""
    (tmp / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    return write_inventory(
        tmp / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair(baseline_url, candidate_url),
            "gates": {"exactness": {"max_new_tokens": 8, "top_k": 3}},
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )


def _answers(inv: Path, tmp: Path) -> dict[str, Any]:
    status = kdctl("status", "-i", str(inv), "--json", "--timeout", "5")
    phases = kdctl("phases", "-i", str(inv), "--json")
    report = kdctl("report", "-i", str(inv), "-o", str(tmp / "report"), "--json")
    can = [
        json.loads(status.out)["answers"]["cutover"]["can_cut_over"],
        json.loads(phases.out)["answers"]["cutover"]["can_cut_over"],
        json.loads(report.out)["answers"]["cutover"]["can_cut_over"],
    ]
    assert len(set(can)) == 1, can
    assert phases.code == report.code == (0 if can[0] else 1)
    criterion = json.loads(phases.out)["phases"][0]["criteria"][0]
    return {"can": can[0], "criterion": criterion}


def test_weights_replaced_under_the_same_path_make_old_evidence_stale(
    tmp_path: Path, models: dict[str, Path], reference_server: Served
) -> None:
    path = tmp_path / "weights" / "candidate"
    shutil.copytree(models["dsv3"], path)
    candidate = serve_reference(path)
    inv = _inventory(tmp_path, reference_server.url, candidate.url)
    try:
        ran = kdctl("phases", "--run", "-i", str(inv), "--json")
        assert ran.code == 0, ran.out + ran.err
        before = _answers(inv, tmp_path)
        assert before["can"] is True and before["criterion"]["state"] == "pass"
        listed = kdctl("evidence", "list", "--gate", "exactness", "--json", "-i", str(inv))
        recorded = json.loads(listed.out)["results"][0]["provenance"]
        assert recorded["weights"] and recorded["host_id"] and recorded["baseline_weights"]

        # Other weights under the same path, the engine restarted on them: its model path,
        # version and every declared field are what they were.
        candidate.proc.terminate()
        candidate.proc.wait(10)
        shutil.rmtree(path)
        shutil.copytree(models["dsv3-int4"], path)
        candidate = serve_reference(path)
        inv.write_text(inv.read_text().replace(candidate_url_of(inv), candidate.url))
        after = _answers(inv, tmp_path)
        assert after["can"] is False
        c = after["criterion"]
        assert c["state"] == "stale" and "weights" in c["stale_by"], c
        # Unmet, so `phases --run` measures it again, and the new weights fail it.
        rerun = kdctl("phases", "--run", "-i", str(inv), "--json")
        assert rerun.code == 1, rerun.out + rerun.err
        c = json.loads(rerun.out)["phases"][0]["criteria"][0]
        assert c["state"] == "fail" and c["verdict"] == "fail", c
        assert [(v["metric"], v["ok"]) for v in c["values"]] == [("match_rate", False)], c
    finally:
        candidate.proc.terminate()
        candidate.proc.wait(10)


def candidate_url_of(inv: Path) -> str:
    return str(yaml.safe_load(inv.read_text())["backends"]["candidate"]["url"])


def test_a_result_under_other_settings_does_not_meet_a_criterion(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    """The criterion pins every setting of the gate as the inventory gives it: an exactness run
    of one token, from an inventory edited for the occasion, passes but completes nothing."""
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    data = {
        "hosts": {"local": {"transport": "local"}},
        "backends": engine_pair(reference_server.url, twin_server.url),
        "gates": {"exactness": {"max_new_tokens": 8, "top_k": 3}},
        "roadmap": "roadmap.yaml",
        "state_dir": "state",
    }
    inv = write_inventory(tmp_path / "inv.yaml", data)
    data["gates"]["exactness"]["max_new_tokens"] = 1
    shortcut = write_inventory(tmp_path / "shortcut.yaml", data)
    golden = kdctl("baseline", "record", "-b", "baseline", "--only", "golden", "-i", str(shortcut))
    assert golden.code == 0, golden.err
    run = kdctl("gate", "run", "exactness", "-b", "candidate", "-i", str(shortcut))
    assert run.code == 0, run.out + run.err
    assert "comparing with baseline, the roadmap's serving backend" in run.err
    got = _answers(inv, tmp_path)
    assert got["can"] is False
    c = got["criterion"]
    assert c["state"] == "missing" and c["evidence_id"] is None, c
    assert c["pinned"]["max_new_tokens"] == 8 and c["pinned"]["mode"] == "strict"


def test_a_promotion_holds_only_while_the_front_answers_from_it() -> None:
    """What the front answered just now against a recorded promotion of native: an answer from
    it with all traffic on it holds (also from a router that names no engine per answer);
    another engine answering, a split, a front that serves nothing or cannot be asked do not."""
    from kdctl.evidence import FrontNow

    def front(answered: bool | None, backend: str | None, weights: dict[str, int]) -> FrontNow:
        return FrontNow(answered=answered, backend=backend, weights=weights, detail="seen")

    assert front(True, "native", {"native": 100}).promoted("native") is None
    assert front(True, None, {"native": 100}).promoted("native") is None
    moved = front(True, "sglang", {"sglang": 100}).promoted("native")
    assert moved is not None and moved.startswith("the front answers from sglang now")
    split = front(True, "native", {"sglang": 95, "native": 5}).promoted("native")
    assert split is not None and "'sglang': 95" in split
    down = front(False, None, {"native": 100}).promoted("native")
    assert down == "the front serves nothing (seen): all traffic on native is not seen"
    unknown = front(None, None, {"native": 100}).promoted("native")
    assert unknown is not None and "cannot be asked from here" in unknown
    # One answer from native, the router's weights unread (its file out of reach, say):
    # native serves, all traffic on it is not seen.
    unread = FrontNow(answered=True, backend="native", weights={}, detail="seen", unread="SSH")
    assert unread.promoted("native") == (
        "the router's weights could not be read (SSH): all traffic on native is not seen"
    )


def test_an_engine_restarted_under_other_settings_makes_old_evidence_stale(
    tmp_path: Path, models: dict[str, Path], reference_server: Served
) -> None:
    """Evidence taken while the candidate decoded speculatively, then the same engine on the
    same weights restarted without its draft: what its server arguments say now decides."""
    candidate = serve_reference(models["dsv3"], draft=models["dsv3-draft"])
    inv = _inventory(tmp_path, reference_server.url, candidate.url)
    try:
        ran = kdctl("phases", "--run", "-i", str(inv), "--json")
        assert ran.code == 0, ran.out + ran.err
        assert _answers(inv, tmp_path)["criterion"]["state"] == "pass"
        listed = kdctl("evidence", "list", "--gate", "exactness", "--json", "-i", str(inv))
        recorded = json.loads(listed.out)["results"][0]["provenance"]
        assert recorded["engine_settings_named"]["speculative_algorithm"] == "STANDALONE"

        candidate.proc.terminate()
        candidate.proc.wait(10)
        candidate = serve_reference(models["dsv3"])
        inv.write_text(inv.read_text().replace(candidate_url_of(inv), candidate.url))
        after = _answers(inv, tmp_path)
        assert after["can"] is False
        c = after["criterion"]
        assert c["state"] == "stale" and c["stale_by"] == ["engine_settings"], c
        assert "speculative_algorithm STANDALONE -> None" in c["reason"], c
    finally:
        candidate.proc.terminate()
        candidate.proc.wait(10)


def test_prompts_edited_in_place_or_settings_changed_leave_old_results_standing_for_nothing(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    """The corpus keeps its name and gains prompts: the exactness pass measured on the old ones
    no longer meets the criterion, in phases, status and the cutover answer alike, and says why.
    The inventory's gate settings changed since a run: status's latest verdict is stale too."""
    corpus = tmp_path / "prompts.jsonl"
    lines = (REPO / "roadmap" / "prompts" / "k26.jsonl").read_text().splitlines()
    corpus.write_text("\n".join(lines[:2]) + "\n")
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    data: dict[str, Any] = {
        "hosts": {"local": {"transport": "local"}},
        "backends": engine_pair(reference_server.url, twin_server.url),
        "gates": {
            "exactness": {
                "max_new_tokens": 4,
                "top_k": 3,
                "mode": "strict",
                "corpus": "prompts.jsonl",
            }
        },
        "roadmap": "roadmap.yaml",
        "state_dir": "state",
    }
    inv = write_inventory(tmp_path / "inv.yaml", data)
    for args in (
        ("baseline", "record", "-b", "baseline", "--only", "golden"),
        ("gate", "run", "exactness", "-b", "candidate"),
    ):
        ran = kdctl(*args, "-i", str(inv))
        assert ran.code == 0, ran.out + ran.err
    got = _answers(inv, tmp_path)
    assert got["criterion"]["state"] == "pass", got["criterion"]

    corpus.write_text("\n".join(lines[:4]) + "\n")
    got = _answers(inv, tmp_path)
    assert got["can"] is False
    c = got["criterion"]
    assert c["state"] == "stale" and c["stale_by"] == ["workload"], c
    assert "measured on another workload" in c["reason"], c
    assert "its prompts changed under the same settings" in c["reason"], c
    status = json.loads(kdctl("status", "-i", str(inv), "--json", "--timeout", "5").out)
    (latest,) = [v for v in status["gates"] if v["gate"] == "exactness"]
    assert latest["fresh"] is False and "measured on another workload" in latest["freshness"]

    corpus.write_text("\n".join(lines[:2]) + "\n")  # the prompts measured, back again
    data["gates"]["exactness"]["max_new_tokens"] = 6
    write_inventory(inv, data)
    status = json.loads(kdctl("status", "-i", str(inv), "--json", "--timeout", "5").out)
    (latest,) = [v for v in status["gates"] if v["gate"] == "exactness"]
    assert latest["fresh"] is False, latest
    assert "measured under other exactness settings (max_new_tokens differ" in latest["freshness"]


def test_a_stopped_swap_candidate_on_a_host_that_cannot_be_read_is_not_cleared(
    tmp_path: Path, reference_server: Served
) -> None:
    """The candidate shares the serving engine's GPUs and is stopped, so its evidence would be
    held to what its host shows; the host does not answer (SSH refused), so nothing is held:
    answer 3 says no, naming the host."""
    from tests.support.sshd import free_port

    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    backends = engine_pair(reference_server.url, f"http://127.0.0.1:{free_port()}")
    for entry in backends.values():
        entry.update(host="box", gpus=[0])
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {
                "box": {
                    "address": "127.0.0.1",
                    "port": free_port(),
                    "user": "ops",
                    "identity_file": "home/.ssh/id_ed25519",
                    "known_hosts": "home/.ssh/known_hosts",
                }
            },
            "backends": backends,
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )
    for name in ("id_ed25519", "known_hosts"):
        (tmp_path / "home" / ".ssh").mkdir(parents=True, exist_ok=True)
        (tmp_path / "home" / ".ssh" / name).touch()
    phases = kdctl("phases", "-i", str(inv), "--json")
    answer = json.loads(phases.out)["answers"]["cutover"]
    assert answer["can_cut_over"] is False and answer["held"] is None, answer
    # Traffic cannot move to an engine nothing ties to its evidence: the first blocker.
    first = answer["blockers"][0]
    assert first["kind"] == "not-answering", answer
    assert first["reason"].startswith("candidate is stopped and its host box could not be read")


def test_a_result_run_under_a_criterions_own_settings_holds_in_status(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    """`phases --run` runs exactness under the criterion's `mode: strict`, not the inventory's
    mode: status's latest verdict is that measurement, and it holds."""
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair(reference_server.url, twin_server.url),
            "gates": {"exactness": {"max_new_tokens": 4, "top_k": 3, "mode": "logprob-close"}},
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )
    ran = kdctl("phases", "--run", "--phase=exact", "-i", str(inv), "--json")
    assert json.loads(ran.out)["phases"][0]["criteria"][0]["state"] == "pass", ran.out + ran.err
    status = json.loads(kdctl("status", "-i", str(inv), "--json", "--timeout", "5").out)
    (latest,) = [
        v for v in status["gates"] if (v["gate"], v["backend"]) == ("exactness", "candidate")
    ]
    assert latest["fresh"] is True, latest


def test_an_imported_pass_missing_a_field_of_what_it_measured_stands_for_nothing(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    """A passing result exported, one field of what it measured nulled (its digest made
    again, as anyone who edits the file can), and imported elsewhere: while the engines
    answer and report that field, the pass stands for nothing, naming the field. Unedited, it
    stands."""
    inv = _inventory(tmp_path, reference_server.url, twin_server.url)
    ran = kdctl("phases", "--run", "-i", str(inv), "--json")
    assert ran.code == 0, ran.out + ran.err
    exported = tmp_path / "evidence.json"
    out = kdctl("evidence", "export", "--gate", "exactness", "-i", str(inv), "-o", str(exported))
    assert out.code == 0, out.err
    doc = json.loads(exported.read_text())

    def imported(field: str, value: Any) -> dict[str, Any]:
        edited = copy.deepcopy(doc)
        for r in edited["results"]:
            if field:
                r["provenance"][field] = value
        # The digest over the records as kdctl reads them back, as export makes it.
        parsed = EvidenceFile.model_validate(edited)
        edited["digest"] = content_hash(
            parsed.model_dump(mode="json", include={"results", "baselines"})
        )
        path = tmp_path / f"edited-{field or 'none'}.json"
        path.write_text(json.dumps(edited))
        state = tmp_path / f"elsewhere-{field or 'none'}"
        done = kdctl("evidence", "import", str(path), "-i", str(inv), "--state-dir", str(state))
        assert done.code == 0, done.err
        phases = kdctl("phases", "-i", str(inv), "--state-dir", str(state), "--json")
        assert phases.code in (0, 1), phases.err
        return dict(json.loads(phases.out)["phases"][0]["criteria"][0])

    assert imported("", None)["state"] == "pass"
    fields = (
        "engine_version",
        "engine_settings",
        "model_path",
        "config_hash",
        "tp_size",
        "host",
        "weights",
        "host_id",
        "baseline_engine_version",
        "baseline_weights",
        "baseline_host_id",
    )
    assert {f for f in fields if doc["results"][0]["provenance"][f] is None} == set()
    for field in fields:
        c = imported(field, None)
        assert c["state"] == "stale" and c["stale_by"] == [field], (field, c)
        assert f"{field}: recorded without" in c["reason"], (field, c["reason"])


def test_a_command_mode_engine_rebuilt_in_place_leaves_its_results_standing_for_nothing(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """The native engine before it serves: a program measured greedy-exact against the
    reference, then rebuilt in place under the same version string (a daily build). Its host
    shows another file: its results stand for nothing, said without running it (`phases`, as
    `status`) and with (`phases --deep`)."""
    program = tmp_path / "kdtree-batch"
    model = models["dsv3"]
    engine = warm_argv([sys.executable, "-m", "kdctl", "reference", "batch", "--model", str(model)])

    def build() -> None:
        new = tmp_path / "kdtree-batch.new"
        new.write_text(f'#!/bin/sh\nexec {shlex.join(engine)} "$@"\n')
        new.chmod(0o755)
        new.replace(program)

    build()
    roadmap = {
        "title": "Rebuilt",
        "serving": "reference-tiny",
        "candidate": "native-tiny",
        "phases": [
            {
                "id": "core",
                "title": "Greedy-exact on the tiny model",
                "criteria": [
                    {
                        "gate": "exactness",
                        "backend": "native-tiny",
                        "baseline": "reference-tiny",
                        "settings": {"mode": "strict", "max_new_tokens": 4},
                    }
                ],
            }
        ],
    }
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(roadmap, sort_keys=False))
    command = {"kind": "native", "mode": "command", "host": "local", "model": str(model)}
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "native-tiny": {**command, "command": [str(program)]},
                "reference-tiny": {**command, "command": engine},
            },
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )

    def criterion(*extra: str) -> dict[str, Any]:
        run = kdctl("phases", *extra, "-i", str(inv), "--json", timeout=300)
        assert run.code in (0, 1), run.out + run.err
        return dict(json.loads(run.out)["phases"][0]["criteria"][0])

    assert criterion("--run")["state"] == "pass"
    assert criterion()["state"] == "pass"
    build()
    for extra in ((), ("--deep",)):
        c = criterion(*extra)
        assert c["state"] == "stale" and c["stale_by"] == ["engine_binary"], (extra, c)
        assert "engine_binary" in c["reason"], c["reason"]
