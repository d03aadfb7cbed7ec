"""Public tests for bucket-handoff: your sender against a real engine in another process."""
import pytest

from course_lib.weights.checkpoint import CheckpointReader, make_random
from handoff import EngineProcess

NUM_BUFFERS = 2


@pytest.fixture(scope="module")
def sent(candidate, tmp_path_factory):
    """One full update from your sender into an engine started on other weights."""
    root = tmp_path_factory.mktemp("ckpts")
    a, b = make_random(root / "a", "tiny", seed=1), make_random(root / "b", "tiny", seed=2)
    engine = EngineProcess(a)
    try:
        report = engine.run(candidate.send_weights, list(CheckpointReader(b).iter_tensors()),
                            bucket_bytes=64 << 10, num_buffers=NUM_BUFFERS)
        report["differ"] = engine.compare(b)
    finally:
        engine.close()
    return report


def test_the_engine_ends_with_the_weights_sent(sent):
    assert not sent["differ"], (
        f"the engine's weights equal the checkpoint sent, but {len(sent['differ'])} tensors differ "
        f"(e.g. {sent['differ'][:3]}): a buffer was written again before the engine had read the bucket in it")


def test_a_buffer_is_reused_only_after_its_ack(sent):
    assert sent["max_in_flight"] <= NUM_BUFFERS, (
        f"at most {NUM_BUFFERS} buckets in flight with {NUM_BUFFERS} buffers, but {sent['max_in_flight']} were "
        f"(buckets in flight at each post: {sent['in_flight_at_post']})")


def test_buckets_overlap(sent):
    assert sent["max_in_flight"] >= NUM_BUFFERS, (
        f"with {NUM_BUFFERS} buffers the next bucket is posted while the engine applies the last, but never more "
        f"than {sent['max_in_flight']} was in flight (at each post: {sent['in_flight_at_post']})")


def test_returns_only_after_every_ack(sent):
    assert not sent["unacked_at_return"], (
        f"send_weights returned while buckets {sent['unacked_at_return']} were not yet acknowledged; "
        f"its caller may then free or overwrite their memory")


def test_returns_the_number_of_buckets(sent):
    assert sent["returned"] == sent["posted"], \
        f"send_weights returns the number of buckets it posted ({sent['posted']}), it returned {sent['returned']!r}"
