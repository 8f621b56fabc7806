# Stand-in for sglang/srt/disaggregation/base/__init__.py (alphabetc1/sglang d6a0fe41): the same
# re-exports.
from sglang.srt.disaggregation.base.conn import (  # noqa: F401
    BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver, BaseKVSender, KVArgs, KVPoll)
