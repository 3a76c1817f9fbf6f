"""The admission lanes: the Gradio `concurrency_id` of each kind of queued event. The app admits
jobs per lane (`gradio_internals.admit_jobs`, wired in cli/app.py) and each event names its lane
where the UI registers it; this module is the one home of the names."""

from __future__ import annotations

# The concurrency id of everything that touches the device: the model is not re-entrant, so these
# events queue behind each other, as many at once as there are engines (--devices; one with
# --device); /status, /cancel and the Stop buttons stay outside it.
DEVICE_GROUP = "device"
# The lane of a remote rewriter (--rewriter-url): network waits, not device work, so it does not
# queue behind edits; bounded like the device lane (--max-queue, --max-jobs-per-client). The local
# rewriter runs on the device and uses DEVICE_GROUP.
REWRITER_GROUP = "rewriter"
REWRITER_CONCURRENCY = 4
# The settings-from-PNG reader (History tab): it decodes a client's file, so it runs queued on a
# small lane of its own, bounded like the device lane (admission), never beside the queue.
SETTINGS_FILE_GROUP = "settings-file"
SETTINGS_FILE_CONCURRENCY = 2
# The History refresh (page load, History tab opened): it reads the list a browser sends back,
# which the browser can make as long as --max-body-kb allows, so it is queued on a small lane of its
# own, bounded like the device lane (admission), never beside the queue.
HISTORY_GROUP = "history"
HISTORY_CONCURRENCY = 2
# The Speed setting (/set_speed): instant and engine-wide; queued so that it has one way in, on a
# lane of its own so that it never waits behind edits.
CONTROL_GROUP = "control"

# Every lane the app admits jobs on (cli/app.py hands this to gradio_internals.admit_jobs).
ALL_LANES = (DEVICE_GROUP, REWRITER_GROUP, SETTINGS_FILE_GROUP, HISTORY_GROUP, CONTROL_GROUP)

# Inputs added at the end of an event after clients were written against it, by api_name: a raw REST
# client that posts the older, shorter `data` list gets None for them (gradio itself refuses a short
# list). gradio_client fills them in from the API info by itself.
LATE_INPUTS = {"edit": ("mask",), "edit_rewritten": ("mask",), "compare": ("mask",)}
