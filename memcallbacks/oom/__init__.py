"""Out of memory, explained: where it struck, what filled the memory, the change that makes it fit.

Runs only when an OOM unwinds (or in the pre-flight): nothing here is on a healthy step's path.
:func:`explain_oom` reads the exception's traceback (the phase, the innermost module, the model
call), counts the memory by category and asks the pre-flight what each remedy saves. See docs/oom.md.
"""

from memcallbacks.oom.accounting import Accounting
from memcallbacks.oom.explanation import OomExplanation, explain_oom, explain_prediction, oom_file_name, write_oom_json
from memcallbacks.oom.recognise import is_oom, oom_source, requested_bytes
from memcallbacks.oom.remedies import Remedy, StepModel
from memcallbacks.oom.where import Where

__all__ = ["Accounting", "OomExplanation", "Remedy", "StepModel", "Where", "explain_oom", "explain_prediction", "is_oom",
           "oom_file_name", "oom_source", "requested_bytes", "write_oom_json"]
