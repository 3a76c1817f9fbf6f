"""`EditForm`: one submission of the Edit tab (or of ``/edit``, ``/edit_rewritten``) as a typed object.

Gradio hands a handler its inputs one positional value per widget, in the order of the API's
inputs (a contract: clients call ``/edit`` by those names and in that order). The handler's entry
turns them into an `EditForm` at once and passes that on; nothing after it reads widget values.
The fields between `image` and `mask` are the Edit form's, hidream_ui.edits.EDIT_FORM (one
schema for widgets, flags, API and README), in its order: the check below the class fails the
import when the schema and this form disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hidream_ui.edits import EDIT_FORM, EditParams, params_from_form
from hidream_ui.rewrite.prompt import RewriteResult


@dataclass(frozen=True)
class EditForm:
    """The values as sent, nothing opened or validated yet: `params()` validates the fields
    (RequestError names the bad one); the handler opens `image` and `mask` through the upload gate."""

    image: Any  # the source as gradio sent it (preprocess=False): a stored file's FileData or path
    # The fields of EDIT_FORM, as the widgets (or a client) sent them: API clients may send text
    # for a number, None for a cleared box. Typed by what the widget sends.
    instruction: str | None
    negative_prompt: str | None
    guidance_scale: float | None
    image_guidance_scale: float | None
    num_inference_steps: int | None
    refine_strength: float | None
    clip_cfg_norm: bool | None
    working_resolution: str | int | None
    seed: int | None
    randomize_seed: bool | None
    collapse_padding: bool | None
    mask: Any = None  # the region editor's value or an uploaded mask file (None: the whole image)
    rewrite: bool = False  # /edit: rewrite the instruction first (with the configured rewriter)
    rewritten_from: RewriteResult | None = None  # /edit_rewritten: the rewriter's answer, recorded

    def fields(self) -> dict[str, Any]:
        """The EDIT_FORM fields, by name (what the schema's conversions take)."""
        return {name: getattr(self, name) for name in EDIT_FORM}

    def params(self) -> EditParams:
        """The validated parameters of the edit (hidream_ui.edits.params_from_form)."""
        return params_from_form(self.fields())

    @property
    def is_empty(self) -> bool:
        """No image and no instruction: the visitor has not started (one message says both)."""
        return self.image is None and not str(self.instruction or "").strip()


def _check_against_schema() -> None:
    """The form's fields between `image` and `mask` are EDIT_FORM, in order (the API's inputs)."""
    names = tuple(field.name for field in dataclasses.fields(EditForm))
    fields = names[names.index("image") + 1 : names.index("mask")]
    if fields != EDIT_FORM:
        missing = [name for name in EDIT_FORM if name not in fields]
        extra = [name for name in fields if name not in EDIT_FORM]
        raise TypeError(
            f"EditForm's fields {fields} are not hidream_ui.edits.EDIT_FORM {EDIT_FORM} "
            f"(missing {missing}, not in the schema {extra}): update EditForm and the /edit handlers"
        )


_check_against_schema()

__all__ = ["EditForm"]
