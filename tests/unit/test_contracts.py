import msgspec
import pytest

from llmgw import contracts as c
from llmgw import subjects as s
from tests.contract_examples import all_examples, build


@pytest.mark.parametrize("msg", all_examples(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(msg):
    raw = c.encode(msg)
    assert c.decode(raw) == msg
    assert c.decode(raw, type(msg)) == msg
    # The wire form carries the envelope every consumer relies on.
    wire = msgspec.json.decode(raw)
    assert wire["type"] == c.type_tag(type(msg))
    assert {"v", "id", "ts"} <= wire.keys()


def test_every_message_has_a_distinct_tag_and_docs():
    tags = [c.type_tag(cls) for cls in c.ALL_MESSAGES]
    assert len(tags) == len(set(tags))
    for cls in c.ALL_MESSAGES:
        assert cls.publisher, cls
        assert cls.summary, cls


def test_defaults_give_each_message_a_fresh_id_and_time():
    a = c.ModelRemoved(name="m")
    b = c.ModelRemoved(name="m")
    assert a.id != b.id
    assert a.ts > 0 and a.v == c.SCHEMA_VERSION


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"not json", "malformed"),
        (b"", "empty"),
        (b'{"type": "no.such.type", "v": 1, "id": "x", "ts": 1}', "unknown type"),
        (b'{"v": 1, "id": "x", "ts": 1, "name": "m"}', "no type tag"),
        (b'{"type": "catalog.model.removed", "v": 1, "id": "x", "ts": 1}', "missing field"),
        (b'{"type": "catalog.model.removed", "v": 1, "id": "x", "ts": 1, "name": 5}', "wrong type"),
        (
            b'{"type": "catalog.model.removed", "v": 99, "id": "x", "ts": 1, "name": "m"}',
            "newer version",
        ),
        (b"[1, 2, 3]", "not an object"),
    ],
)
def test_malformed_payloads_raise_the_one_typed_error(raw, reason):
    with pytest.raises(c.ContractError) as info:
        c.decode(raw)
    assert info.value.raw == raw
    assert info.value.reason


def test_decode_narrowed_to_a_kind_rejects_other_types():
    raw = c.encode(c.ModelRemoved(name="m"))
    with pytest.raises(c.ContractError):
        c.decode(raw, c.Command)


def test_unknown_extra_fields_are_tolerated_for_forward_compatibility():
    wire = msgspec.json.decode(c.encode(c.ModelRemoved(name="m")))
    wire["added_later"] = {"x": 1}
    assert c.decode(msgspec.json.encode(wire)).name == "m"


def test_every_published_message_has_a_subject_and_per_node_prefixes():
    for msg in all_examples():
        # Projection records live in KV buckets; a KV snapshot is a reply to an inbox.
        unrouted = (c.ModelEndpoints, c.TenantRecord, c.BandsRecord, c.RouterPresence, c.KvSnapshot)
        if isinstance(msg, unrouted):
            with pytest.raises(s.SubjectError):
                s.subject_for(msg)
            continue
        subject = s.subject_for(msg)
        assert subject.startswith("llmgw.")
    reg = build(c.NodeRegistered)
    reg.node = "node-a"
    assert s.subject_for(reg) == "llmgw.evt.agent.node-a.registered"
    assert s.node_of_subject(s.subject_for(reg)) == "node-a"
    assert s.node_of_subject(s.commands("node-b")) == "node-b"
    assert s.node_of_subject("llmgw.evt.catalog.model.m") is None


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "a>", "a b"])
def test_node_ids_that_would_break_subjects_are_refused(bad):
    with pytest.raises(s.SubjectError):
        s.heartbeat(bad)


def test_model_names_are_mapped_onto_one_token():
    assert s.catalog_event("model", "org/llama:3.1") == "llmgw.evt.catalog.model.org_llama_3_1"


def test_every_channel_has_one_route_and_every_message_one_channel():
    assert list(s.ROUTES) == list(c.CHANNELS)
    assert len(c.ALL_MESSAGES) == len(set(c.ALL_MESSAGES)) == len(c.CHANNEL_OF)
    assert [ch[0] for ch in s.CHANNELS] == list(c.CHANNELS)


def test_subjects_are_those_already_on_the_wire():
    # Streams hold events published under these subjects; a change would split history.
    def subject(cls, **fields):
        msg = build(cls)
        for k, v in fields.items():
            setattr(msg, k, v)
        return s.subject_for(msg)

    assert subject(c.ShardStatus, node="n1") == "llmgw.evt.agent.n1.shard"
    assert subject(c.ModelDeclared, name="m/1") == "llmgw.evt.catalog.model.m_1"
    assert subject(c.ModelRemoved, name="m") == "llmgw.evt.catalog.model.m"
    assert subject(c.TenantRemoved, name="t") == "llmgw.evt.catalog.tenant.t"
    assert subject(c.BandsDeclared) == "llmgw.evt.catalog.bands.all"
    for cls in (c.PlacementDecided, c.PlacementFailed, c.ReplicaRetired):
        assert subject(cls, replica_id="m-r1") == "llmgw.evt.control.placement.m-r1"
    for cls in (c.NodeUnreachable, c.NodeLost, c.NodeRecovered):
        assert subject(cls, node="n2") == "llmgw.evt.control.node.n2"
    assert subject(c.Heartbeat, node="n3") == "llmgw.hb.n3"
    for cls in (c.StartShard, c.StopShard, c.DrainShard):
        assert subject(cls, node="n4") == "llmgw.cmd.n4"
    assert subject(c.LoadSample, node="n5") == "llmgw.load.n5"
