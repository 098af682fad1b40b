"""The evidence store: SQLite with WAL and migrations, freshness, export and import."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from kdctl.errors import InputError
from kdctl.evidence import (
    EvidenceStore,
    SqliteStore,
    currency,
    export_evidence,
    freshness,
    import_evidence,
    open_url,
)
from kdctl.evidence._schema import MIGRATIONS, SCHEMA_VERSION
from kdctl.records import Baseline, GateResult, Metric, Provenance, utcnow
from tests.conftest import kdctl, write_inventory

PROV = Provenance(
    engine_version="sglang 0.5.23",
    model_path="/models/Kimi-K2.6-INT4",
    config_hash="c0ffee",
    host="ct200",
    gpus=[0, 1, 2, 3, 4, 5, 6, 7],
    tp_size=8,
    workload_hash="w1",
    kdctl_version="0.1.0",
)


def result(
    gate: str = "throughput", verdict: str = "pass", age_s: float = 60, **kw: object
) -> GateResult:
    end = utcnow() - timedelta(seconds=age_s)
    return GateResult(
        gate=gate,
        backend=str(kw.get("backend", "native")),
        baseline="sglang",
        verdict=verdict,  # type: ignore[arg-type]
        metrics=[
            Metric(name="output_throughput_ratio", value=1.07, threshold=1.0, comparison=">=")
        ],
        reasons=["output token throughput 1.07x the baseline's"],
        provenance=PROV,
        started_at=end - timedelta(seconds=30),
        ended_at=end,
    )


def test_store_round_trip_in_wal_mode(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "state" / "evidence.sqlite") as store:
        assert store.schema_version == SCHEMA_VERSION
        old, new = result(age_s=600), result(age_s=5)
        store.record(old)
        store.record(new)
        store.record(result(gate="exactness", backend="candidate"))
        assert [r.id for r in store.results(gate="throughput")] == [new.id, old.id]
        assert store.latest("throughput", "native") == new
        assert store.get(new.id[:10]) == new
        assert store.get("0" * 32) is None
        base = Baseline(
            backend="sglang",
            kind="golden",
            workload_hash="w1",
            provenance=PROV,
            payload={"prompts": [[1, 2, 3]]},
        )
        store.record_baseline(base)
        assert store.baselines(backend="sglang", kind="golden", workload_hash="w1") == [base]
        assert store.baselines(workload_hash="other") == []
    mode = (
        sqlite3.connect(tmp_path / "state" / "evidence.sqlite")
        .execute("PRAGMA journal_mode")
        .fetchone()[0]
    )
    assert mode == "wal"


def test_an_older_database_is_migrated_with_its_data(tmp_path: Path) -> None:
    path = tmp_path / "evidence.sqlite"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("PRAGMA user_version = 1")
    kept = result()
    db.execute(
        "INSERT INTO results (id, gate, backend, baseline, verdict, started_at, ended_at, body)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            kept.id,
            kept.gate,
            kept.backend,
            kept.baseline,
            kept.verdict,
            kept.started_at.isoformat(),
            kept.ended_at.isoformat(),
            kept.model_dump_json(),
        ),
    )
    db.commit()
    db.close()
    with SqliteStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION == 2
        assert store.results() == [kept]
        assert store.baselines() == []  # the table migration 2 added


def test_a_newer_or_foreign_database_is_refused(tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite"
    sqlite3.connect(newer).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(InputError, match="newer than this kdctl understands"):
        SqliteStore(newer)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(InputError, match="the file is damaged"):
        SqliteStore(junk)


def test_freshness_by_age_and_by_provenance() -> None:
    r = result(age_s=1800)
    hour = timedelta(hours=1)
    assert freshness(r, window=hour, current=PROV).fresh
    stale = freshness(r, window=timedelta(minutes=10), current=PROV)
    assert not stale.fresh and stale.changed == ("age",)
    assert timedelta(minutes=29) < stale.age < timedelta(minutes=31)
    assert stale.reason == "stale: 30m old, window 10m"  # what a status line shows
    changed = freshness(r, window=hour, current=PROV.model_copy(update={"config_hash": "d00d"}))
    assert not changed.fresh and changed.changed == ("config_hash",)
    assert "config_hash c0ffee -> d00d" in changed.reason
    unknown = freshness(r, window=hour, current=PROV.model_copy(update={"engine_version": None}))
    assert not unknown.fresh and unknown.changed == ("engine_version",)
    assert "engine_version sglang 0.5.23 -> unknown" in unknown.reason
    tp = freshness(
        r, window=hour, current=PROV.model_copy(update={"tp_size": 4, "gpus": [0, 1, 2, 3]})
    )
    assert not tp.fresh and tp.changed == ("gpus", "tp_size")
    assert "tp_size 8 -> 4" in tp.reason
    # A record that names its host and baseline but not which machines they were (stripped,
    # hand-made) cannot count where the machines can be told apart now; nor one made elsewhere.
    here = PROV.model_copy(update={"host_id": "a1b2", "baseline_host_id": "a1b2"})
    unbound = freshness(r, window=hour, current=here)
    assert not unbound.fresh and unbound.changed == ("host_id", "baseline_host_id")
    assert "host_id: recorded without an identity, now a1b2" in unbound.reason
    assert "baseline_host_id: recorded without an identity" in unbound.reason
    bound = r.model_copy(update={"provenance": here})
    assert freshness(bound, window=hour, current=here).fresh
    other = freshness(bound, window=hour, current=here.model_copy(update={"host_id": "ffff"}))
    assert not other.fresh and other.changed == ("host_id",)
    assert "host_id a1b2 -> ffff" in other.reason
    # A recorded baseline is chosen by the same binding: one without the machine's identity
    # or its checkpoint's fingerprint, where the engine has them now, is not taken for it.
    now = here.model_copy(update={"weights": "9f9f"})
    assert PROV.differs_from(now) == [
        "weights not recorded -> 9f9f",
        "host_id not recorded -> a1b2",
    ]
    assert now.differs_from(now) == []
    # Where the machine cannot be read now (held to the inventory), the record is not faulted.
    assert freshness(r, window=hour, current=PROV, live=False).fresh


def test_a_result_that_does_not_say_which_build_it_measured_does_not_count() -> None:
    """The native engine is rebuilt daily on the same weights: a record of its model with
    no engine build (stripped, hand-made) describes no build, where the engine names one now.
    A host's gate ran no engine and owes none."""
    hour = timedelta(hours=1)
    asked = PROV.with_settings({"tp_size": 8})
    unbuilt = asked.model_copy(update={"engine_version": None})
    stripped = result().model_copy(update={"provenance": unbuilt})
    said = freshness(stripped, window=hour, current=asked)
    assert not said.fresh and said.changed == ("engine_version",)
    assert "engine_version: recorded without the engine's build, now sglang 0.5.23" in said.reason
    # Held to the inventory (the engine did not answer), nothing says which build runs.
    assert freshness(stripped, window=hour, current=unbuilt, live=False).fresh
    # A host's gate, or a cutover's promotion, asked no engine what it runs: none is owed.
    host_gate = result("tp-health").model_copy(
        update={"provenance": PROV.model_copy(update={"engine_version": None})}
    )
    assert freshness(host_gate, window=hour, current=asked).fresh


def test_a_result_holds_only_under_the_engine_settings_it_was_measured_with() -> None:
    """A speed measured while the engine drafted says nothing of it restarted without its
    draft: same version, model, weights and machine, other server arguments."""
    hour = timedelta(hours=1)
    args = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "schedule_policy": "lpm"}
    drafting = PROV.with_settings(args)
    assert drafting.engine_settings_named == {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
    }
    measured = result().model_copy(update={"provenance": drafting})
    assert freshness(measured, window=hour, current=drafting).fresh
    plain = PROV.with_settings({**args, "speculative_algorithm": None})
    off = freshness(measured, window=hour, current=plain)
    assert not off.fresh and off.changed == ("engine_settings",)
    assert "speculative_algorithm EAGLE -> None" in off.reason
    # A setting not named still parts them, said as such.
    fcfs = freshness(
        measured, window=hour, current=PROV.with_settings({**args, "schedule_policy": "fcfs"})
    )
    assert not fcfs.fresh and fcfs.changed == ("engine_settings",)
    assert "an argument not named here" in fcfs.reason
    # A result from before settings were recorded cannot say it ran under these.
    unbound = freshness(result(), window=hour, current=drafting)
    assert not unbound.fresh and unbound.changed == ("engine_settings",)
    assert "recorded without the engine's settings" in unbound.reason
    # Nor can a recorded baseline run, which is then passed over.
    assert PROV.differs_from(drafting) == [
        f"engine_settings not recorded -> {drafting.engine_settings}"
    ]
    assert drafting.differs_from(plain) == ["engine settings: speculative_algorithm EAGLE -> None"]
    # The baseline a ratio was measured against is held to its settings the same way.
    compared = drafting.with_baseline(PROV.with_settings({"cuda_graph_max_bs": 8}))
    ratio = result().model_copy(update={"provenance": compared})
    assert freshness(ratio, window=hour, current=compared).fresh
    retuned = drafting.with_baseline(PROV.with_settings({"cuda_graph_max_bs": 64}))
    moved = freshness(ratio, window=hour, current=retuned)
    assert not moved.fresh and moved.changed == ("baseline_engine_settings",)
    assert "baseline's engine settings: cuda_graph_max_bs 8 -> 64" in moved.reason
    # A gate that asked no engine (a host's) owes none; an engine that cannot say its settings
    # (the OpenAI API has no such route) holds a result to none.
    host_only = PROV.model_copy(update={"engine_version": None})
    assert freshness(
        result(gate="tp-health").model_copy(update={"provenance": host_only}),
        window=hour,
        current=drafting.model_copy(update={"engine_version": None}),
    ).fresh
    assert freshness(result(), window=hour, current=PROV).fresh


def test_nothing_null_in_a_pass_passes_as_a_match() -> None:
    """A pass whose record lacks any field of what it measured (the engine's build, model,
    configuration, TP size, host, GPUs, the baseline's build), where what runs now has it,
    cannot say it measured what runs: stale, naming the field. A failure is not held to them
    (it claims nothing), nor is a gate that asks no engine held to the engine's fields."""
    hour = timedelta(hours=1)
    now = PROV.with_baseline(PROV).model_copy(update={"engine_binary": "5eed"})
    whole = result().model_copy(update={"provenance": now})
    assert freshness(whole, window=hour, current=now).fresh
    for field, empty in (
        ("engine_version", None),
        ("model_path", None),
        ("config_hash", None),
        ("tp_size", None),
        ("host", None),
        ("gpus", []),
        ("engine_binary", None),
        ("baseline_engine_version", None),
    ):
        stripped = now.model_copy(update={field: empty})
        passed = whole.model_copy(update={"provenance": stripped})
        said = freshness(passed, window=hour, current=now)
        assert not said.fresh and said.changed == (field,), (field, said)
        assert f"{field}: recorded without" in said.reason, said.reason
        failed = passed.model_copy(update={"verdict": "fail"})
        assert freshness(failed, window=hour, current=now).fresh, field
    host_gate = result(gate="tp-health").model_copy(
        update={"provenance": PROV.model_copy(update={"engine_version": None, "model_path": None})}
    )
    assert freshness(host_gate, window=hour, current=PROV).fresh


def test_one_currency_rule_for_every_answer(tmp_path: Path) -> None:
    """Age, identity, the baseline's identity and the settings it ran under, in one rule: a
    result stands only where each holds, and says which did not."""
    from kdctl.checks import gate_settings, with_settings
    from kdctl.inventory import load_inventory

    inv = load_inventory(
        write_inventory(tmp_path / "inv.yaml", {"hosts": {"local": {"transport": "local"}}})
    )
    hour = timedelta(hours=1)
    ran = result(gate="tp-health").model_copy(update={"settings": gate_settings(inv, "tp-health")})
    assert currency(ran, window=hour, current=PROV, live=True, ways=[inv]).fresh
    unknown = currency(ran, window=hour, current=None, live=False, ways=[inv])
    assert not unknown.fresh and unknown.changed == ("identity",)
    old = currency(ran, window=timedelta(seconds=10), current=PROV, live=True, ways=[inv])
    assert not old.fresh and old.changed == ("age",)
    # Other settings now: stale, unless another way it may stand for (a criterion's) matches,
    # or the caller chose the result by the settings it pins.
    stricter = with_settings(inv, "tp-health", {"min_busbw_gbps": 40})
    other = currency(ran, window=hour, current=PROV, live=True, ways=[stricter])
    assert not other.fresh and other.changed == ("workload",)
    assert "measured under other tp-health settings (min_busbw_gbps" in other.reason
    assert currency(ran, window=hour, current=PROV, live=True, ways=[stricter, inv]).fresh
    assert currency(
        ran, window=hour, current=PROV, live=True, ways=[stricter], settings_matched=True
    ).fresh
    # The baseline compared with is held to what it runs now, beside the engine.
    tuned = PROV.with_settings({"cuda_graph_max_bs": 8})
    compared = ran.model_copy(update={"provenance": PROV.with_baseline(tuned)})
    same = currency(compared, window=hour, current=PROV, live=True, ways=[], baseline=tuned)
    assert same.fresh
    retuned = PROV.with_settings({"cuda_graph_max_bs": 64})
    moved = currency(compared, window=hour, current=PROV, live=True, ways=[], baseline=retuned)
    assert not moved.fresh and moved.changed == ("baseline_engine_settings",)
    assert "cuda_graph_max_bs 8 -> 64" in moved.reason


@pytest.fixture(params=["sqlite", "postgres"])
def new_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], EvidenceStore]:
    """Stores made on demand, of one kind per run of the test: SQLite files, or databases of
    the tests' PostgreSQL cluster."""
    if request.param == "sqlite":
        return lambda name: SqliteStore(tmp_path / f"{name}.sqlite")
    cluster = request.getfixturevalue("postgres")
    return lambda name: open_url(cluster.create_database(), password=cluster.password)


def test_export_import_between_machines(
    tmp_path: Path, new_store: Callable[[str], EvidenceStore]
) -> None:
    box = new_store("box")
    for r in (result(), result(gate="exactness")):
        box.record(r)
    box.record_baseline(Baseline(backend="sglang", kind="throughput", workload_hash="w1"))
    doc = export_evidence(box)
    path = tmp_path / "evidence.json"
    path.write_text(doc.model_dump_json())
    laptop = new_store("laptop")
    first = import_evidence(laptop, path)
    assert (first.added, first.already_present, first.signed) == (3, 0, False)
    again = import_evidence(laptop, path)
    assert (again.added, again.already_present) == (0, 3)  # importing twice changes nothing
    assert sorted(r.id for r in laptop.results()) == sorted(r.id for r in box.results())


def _tamper(path: Path, edit: object) -> None:
    data = json.loads(path.read_text())
    edit(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("name", "edit", "needle"),
    [
        (
            "verdict flipped",
            lambda d: d["results"][0].update(verdict="pass"),
            "does not match its digest",
        ),
        (
            "metric raised",
            lambda d: d["results"][0]["metrics"][0].update(value=9.9),
            "does not match its digest",
        ),
        ("bad verdict", lambda d: d["results"][0].update(verdict="great"), "results[0].verdict"),
        ("not an export", lambda d: d.update(kind="something"), "not a kdctl evidence export"),
        ("unknown field", lambda d: d["results"][0].update(extra=1), "results[0].extra"),
    ],
)
def test_tampered_or_malformed_imports_are_refused(
    tmp_path: Path, new_store: Callable[[str], EvidenceStore], name: str, edit: object, needle: str
) -> None:
    box = SqliteStore(tmp_path / "box.sqlite")
    box.record(result(verdict="fail"))
    path = tmp_path / "e.json"
    path.write_text(export_evidence(box).model_dump_json())
    _tamper(path, edit)
    target = new_store("t")
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        import_evidence(target, path)
    assert target.results() == []  # nothing half-applied


@pytest.mark.parametrize(
    ("shift", "naive", "needle"),
    [
        (timedelta(hours=1), False, "min ahead of this machine's clock"),
        (timedelta(0), True, "has no time zone"),
    ],
)
def test_times_that_cannot_be_ordered_here_are_refused(
    tmp_path: Path, shift: timedelta, naive: bool, needle: str
) -> None:
    """A box whose clock runs an hour ahead, or a file whose times carry no zone: its results
    would outrank every later local one, or could not be compared at all. The whole file is
    refused, naming the record and field."""
    ended = datetime.now(timezone.utc) + shift
    if naive:
        ended = ended.replace(tzinfo=None)
    box = SqliteStore(tmp_path / "box.sqlite")
    box.record(result(verdict="pass").model_copy(update={"started_at": ended, "ended_at": ended}))
    path = tmp_path / "e.json"
    path.write_text(export_evidence(box).model_dump_json())
    target = SqliteStore(tmp_path / "t.sqlite")
    with pytest.raises(InputError, match=r"results\[0\]\.started_at: .*" + needle):
        import_evidence(target, path)
    assert target.results() == []


def test_an_import_from_a_clock_ahead_never_outranks_a_later_result_here(tmp_path: Path) -> None:
    """A box whose clock runs 150 s fast exports a pass (accepted: within the skew allowed);
    its times are moved back to the import moment, saying so, so a fail measured here after
    the import is the newer result, as it was; the same file imported again adds nothing."""
    ahead = datetime.now(timezone.utc) + timedelta(seconds=150)
    box = SqliteStore(tmp_path / "box.sqlite")
    passed = result(verdict="pass").model_copy(
        update={"started_at": ahead - timedelta(seconds=20), "ended_at": ahead}
    )
    box.record(passed)
    path = tmp_path / "e.json"
    path.write_text(export_evidence(box).model_dump_json())
    here = SqliteStore(tmp_path / "here.sqlite")
    before = utcnow()
    assert import_evidence(here, path).added == 1
    (imported,) = here.results()
    assert before <= imported.ended_at <= utcnow()
    assert imported.ended_at - imported.started_at == timedelta(seconds=20)
    assert imported.reasons[-1].startswith("imported with its times moved back 1")
    failed = result(verdict="fail", age_s=0).model_copy(update={"id": "local-fail"})
    here.record(failed)
    newest = here.latest(passed.gate, passed.backend)
    assert newest is not None and newest.verdict == "fail"
    again = import_evidence(here, path)
    assert (again.added, again.already_present) == (0, 1)


def test_conflicting_id_refuses_the_whole_file(
    tmp_path: Path, new_store: Callable[[str], EvidenceStore]
) -> None:
    a = SqliteStore(tmp_path / "a.sqlite")
    first, second = result(), result(gate="exactness")
    a.record(first)
    a.record(second)
    path = tmp_path / "e.json"
    path.write_text(export_evidence(a).model_dump_json())
    b = new_store("b")
    b.record(second.model_copy(update={"verdict": "fail"}))  # same id, other content
    with pytest.raises(InputError, match=f"result {second.id} differs"):
        import_evidence(b, path)
    assert [r.verdict for r in b.results()] == ["fail"]


def test_hmac_when_a_key_is_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = SqliteStore(tmp_path / "box.sqlite")
    box.record(result())
    monkeypatch.setenv("KDCTL_EVIDENCE_KEY", "shared-secret")
    signed = tmp_path / "signed.json"
    signed.write_text(export_evidence(box).model_dump_json())
    done = import_evidence(SqliteStore(tmp_path / "ok.sqlite"), signed, require_signed=True)
    assert (done.added, done.signed) == (1, True)
    monkeypatch.setenv("KDCTL_EVIDENCE_KEY", "another")
    with pytest.raises(InputError, match="HMAC does not verify"):
        import_evidence(SqliteStore(tmp_path / "x.sqlite"), signed)
    monkeypatch.delenv("KDCTL_EVIDENCE_KEY")
    unsigned = tmp_path / "unsigned.json"
    unsigned.write_text(export_evidence(box).model_dump_json())
    monkeypatch.setenv("KDCTL_EVIDENCE_KEY", "shared-secret")
    with pytest.raises(InputError, match="carries no HMAC"):
        import_evidence(SqliteStore(tmp_path / "y.sqlite"), unsigned)
    monkeypatch.delenv("KDCTL_EVIDENCE_KEY")
    with pytest.raises(InputError, match="requires signed evidence"):
        import_evidence(SqliteStore(tmp_path / "z.sqlite"), unsigned, require_signed=True)


def test_evidence_cli(tmp_path: Path) -> None:
    inv = write_inventory(
        tmp_path / "inv.yaml", {"hosts": {"h": {"transport": "local"}}, "state_dir": "st"}
    )
    with SqliteStore(tmp_path / "st" / "evidence.sqlite") as store:
        r = result(verdict="fail")
        store.record(r)
    listed = kdctl("evidence", "list", "-i", str(inv), "--json")
    assert listed.code == 0, listed.err
    assert [x["id"] for x in json.loads(listed.out)["results"]] == [r.id]
    shown = kdctl("evidence", "show", r.id[:8], "-i", str(inv))
    assert shown.code == 0 and "output_throughput_ratio" in shown.out and "fail" in shown.out
    assert kdctl("evidence", "show", "ffff0000", "-i", str(inv)).code == 2
    out = tmp_path / "export.json"
    assert kdctl("evidence", "export", "-i", str(inv), "-o", str(out)).code == 0
    other = write_inventory(
        tmp_path / "other.yaml", {"hosts": {"h": {"transport": "local"}}, "state_dir": "st2"}
    )
    imported = kdctl("evidence", "import", str(out), "-i", str(other), "--json")
    assert imported.code == 0 and json.loads(imported.out)["added"] == 1
    assert json.loads(imported.out)["signed"] is False
    # Without a key, the import says what a digest proves: the file is intact, not who made it.
    said = kdctl("evidence", "import", str(out), "-i", str(other))
    assert said.code == 0 and "unsigned" in said.out, said.out
    strict = write_inventory(
        tmp_path / "strict.yaml",
        {
            "hosts": {"h": {"transport": "local"}},
            "state_dir": "st3",
            "evidence": {"require_signed": True},
        },
    )
    refused = kdctl("evidence", "import", str(out), "-i", str(strict))
    assert refused.code == 2 and "requires signed evidence" in refused.err, refused.err
    out.write_text(out.read_text().replace('"fail"', '"pass"'))
    refused = kdctl("evidence", "import", str(out), "-i", str(other))
    assert refused.code == 2 and "does not match its digest" in refused.err
    assert "Traceback" not in refused.err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "bad.json:1: not JSON" in kdctl("evidence", "import", str(bad), "-i", str(other)).err
