"""The browser's forms. Placement fields are derived from DeploymentModel and
build settings from the build spec's defaults, so the form, the API and the
model agree on every bound."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings

from deployments import build_spec, selectors, trtllm
from deployments.errors import GantryError, ValidationFailed
from deployments.models import BuildStatus, DeploymentModel, ModelKind, RegisteredModel, Runtime, slug_validator
from deployments.services.placements import SERVABLE_KINDS


def placement_field(name: str, **overrides: Any) -> forms.Field:
    """A form field for DeploymentModel.<name>: its validators, choices and default."""
    model_field = DeploymentModel._meta.get_field(name)
    field = model_field.formfield(**overrides)
    field.initial = model_field.get_default()
    return field


class DeployForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[slug_validator], help_text=slug_validator.message)
    host = forms.ChoiceField()
    runtime = forms.ChoiceField(choices=Runtime.choices, initial=Runtime.PROCESS)
    image = forms.ChoiceField(required=False, help_text="Triton image for the docker runtime (allow-listed)")
    # Settings each placed model gets, with DeploymentModel's bounds and defaults.
    max_batch_size = placement_field("max_batch_size")
    max_queue_delay_us = placement_field("max_queue_delay_us", label="Max queue delay (µs)")
    instance_count = placement_field("instance_count")
    instance_kind = placement_field("instance_kind")
    also = forms.MultipleChoiceField(
        required=False,
        label="Also serve in the same Triton server",
        widget=forms.CheckboxSelectMultiple,
    )

    def __init__(self, *args, model: RegisteredModel, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.fields["host"].choices = [(h.name, h.name) for h in selectors.host_list()]
        self.fields["image"].choices = [("", "—")] + [(i, i) for i in settings.GANTRY_ALLOWED_IMAGES]
        others = selectors.model_list().filter(kind__in=SERVABLE_KINDS).exclude(pk=model.pk)
        self.fields["also"].choices = [(m.name, f"{m.name} ({m.kind})") for m in others]
        if model.kind == ModelKind.LLM:
            built = model.builds.filter(status=BuildStatus.SUCCEEDED).order_by("-finished_at")
            self.fields["engine_build"] = forms.ChoiceField(
                label="Engine build",
                choices=[
                    (b.pk, f"build {b.pk}: {b.builder_image}, SM {b.compute_capability}, tp {b.tp_size}") for b in built
                ],
                help_text="served in the image it was built in (runtime docker)",
            )


class BuildForm(forms.Form):
    """The build request of the model page; the rules are deployments.build_spec's."""

    host = forms.ChoiceField()
    image = forms.ChoiceField(label="Builder image", help_text="allow-listed, present on the host")
    dtype = forms.ChoiceField(choices=[(d, d) for d in trtllm.DTYPES])
    quantization = forms.ChoiceField(choices=[(q, q) for q in trtllm.QUANTIZATIONS])
    gemm_plugin = forms.ChoiceField(choices=[(c, c) for c in trtllm.PLUGIN_CHOICES])
    gpt_attention_plugin = forms.ChoiceField(choices=[(c, c) for c in trtllm.PLUGIN_CHOICES])
    paged_context_fmha = forms.BooleanField(required=False, initial=True)
    max_batch_size = forms.IntegerField(min_value=1, max_value=4096, initial=build_spec.DEFAULTS["max_batch_size"])
    max_input_len = forms.IntegerField(min_value=1, initial=build_spec.DEFAULTS["max_input_len"])
    max_seq_len = forms.IntegerField(min_value=1, initial=build_spec.DEFAULTS["max_seq_len"])
    max_num_tokens = forms.IntegerField(min_value=1, initial=build_spec.DEFAULTS["max_num_tokens"])
    tp_size = forms.IntegerField(min_value=1, max_value=64, initial=1)
    pp_size = forms.IntegerField(min_value=1, max_value=64, initial=1)
    workers = forms.IntegerField(min_value=1, max_value=64, initial=1)
    allow_seq_len_over_max_positions = forms.BooleanField(required=False, label="Allow max_seq_len over max positions")
    force = forms.BooleanField(required=False, label="Rebuild even if an identical engine exists")

    SPEC_FIELDS = (
        "dtype", "quantization", "gemm_plugin", "gpt_attention_plugin", "paged_context_fmha", "max_batch_size",
        "max_input_len", "max_seq_len", "max_num_tokens", "tp_size", "pp_size", "workers",
        "allow_seq_len_over_max_positions",
    )  # fmt: skip

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        hosts = list(selectors.host_list())
        self.fields["host"].choices = [(h.name, f"{h.name} ({h.gpus.count()} GPU)") for h in hosts]
        images = sorted({image for h in hosts for image in build_spec.builder_choices(h)})
        self.fields["image"].choices = [(i, i) for i in images]


def show_refusal(form: forms.Form, exc: GantryError) -> None:
    """A service's refusal, shown on the form: each rule beside its field where the form has it."""
    if isinstance(exc, ValidationFailed):
        for field, errors in exc.errors.items():
            form.add_error(field if field in form.fields else None, " ".join(errors))
    else:
        form.add_error(None, str(exc))
