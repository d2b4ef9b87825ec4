"""Property: any interleaving of puts, reads and reopens keeps order and count."""

import shutil
import tempfile
from collections import deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nsqd.diskq import DiskQueue

payload = st.binary(min_size=0, max_size=120)


class QueueMachine(RuleBasedStateMachine):
    """Compares the queue with a deque; small segments force frequent rotation."""

    def __init__(self):
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="diskq-property-")
        self.model: deque[bytes] = deque()
        self.counter = 0
        self.queue = self._open()

    def _open(self):
        return DiskQueue("prop:erty#x", self.directory, max_bytes_per_file=300, max_msg_size=200)

    def _unique(self, body: bytes) -> bytes:
        self.counter += 1
        return self.counter.to_bytes(4, "big") + body

    @rule(body=payload)
    def put(self, body):
        item = self._unique(body)
        self.queue.put(item)
        self.model.append(item)

    @rule(bodies=st.lists(payload, max_size=12))
    def put_many(self, bodies):
        items = [self._unique(body) for body in bodies]
        self.queue.put_many(items)
        self.model.extend(items)

    @rule(count=st.integers(min_value=0, max_value=15))
    def read_many(self, count):
        expected = [self.model.popleft() for _ in range(min(count, len(self.model)))]
        assert self.queue.read_many(count) == expected

    @rule()
    def reopen(self):
        self.queue.close()
        self.queue = self._open()

    @precondition(lambda self: self.model)
    @rule()
    def empty(self):
        self.queue.empty()
        self.model.clear()

    @invariant()
    def depth_matches(self):
        assert self.queue.depth == len(self.model)

    def teardown(self):
        self.queue.close()
        reopened = self._open()
        remaining = []
        while chunk := reopened.read_many(50):
            remaining.extend(chunk)
        reopened.close()
        shutil.rmtree(self.directory)
        assert remaining == list(self.model)
        assert reopened.statistics().corrupt_records_skipped == 0


QueueMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_queue_behaves_like_a_deque = QueueMachine.TestCase
