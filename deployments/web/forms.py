"""The browser's server-side forms. Build settings come from the build spec's
defaults, so the form, the API and the model agree on every bound; the deploy
form is drawn by static/deploy-form.js from DeploymentModel's bounds
(views.deploy_form_options)."""

from __future__ import annotations

from django import forms

from common.errors import GantryError, ValidationFailed
from core.validation import DB_INT_MAX, slug_validator
from deployments import build_spec
from deployments.models import BuildStatus, DeploymentStatus, ModelKind
from hosts import selectors as host_selectors
from upstream import trtllm


class RegisterForm(forms.Form):
    """Register a checkpoint folder on a host, or a hub repository the host
    downloads first; the rules are model_register's."""

    name = forms.CharField(max_length=63, validators=[slug_validator], help_text=slug_validator.message)
    kind = forms.ChoiceField(choices=ModelKind.choices)
    host = forms.ChoiceField(help_text="the GPU host whose disk holds the checkpoint, or that downloads it first")
    path = forms.CharField(
        max_length=1024, required=False,
        help_text="a HuggingFace-format folder on that host, under GANTRY_MODEL_ROOTS; empty: download the hub id",
    )  # fmt: skip
    hub_id = forms.CharField(
        max_length=255, required=False, label="Hub id",
        help_text="owner/name: downloaded into the host's hub cache when no path is given",
    )  # fmt: skip
    revision = forms.CharField(
        max_length=255, required=False, help_text="branch, tag or commit (default main), pinned at the first download"
    )
    allow_patterns = forms.CharField(
        max_length=2000, required=False, label="Only files matching",
        help_text="comma-separated globs, e.g. *.json, *.safetensors, tokenizer*",
    )  # fmt: skip
    ignore_patterns = forms.CharField(
        max_length=2000, required=False, label="Skip files matching", help_text="comma-separated globs, e.g. original/*"
    )
    trust_remote_code = forms.BooleanField(
        required=False,
        label="Allow its remote code",
        help_text="let the checkpoint's own Python code (auto_map) run on the host during inspection and serving",
    )

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.fields["host"].choices = [(h.name, h.name) for h in host_selectors.host_list()]

    def clean_allow_patterns(self) -> list[str]:
        return _globs(self.cleaned_data["allow_patterns"])

    def clean_ignore_patterns(self) -> list[str]:
        return _globs(self.cleaned_data["ignore_patterns"])


def _globs(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


class BuildFilterForm(forms.Form):
    """The builds page's filters (the API's /api/builds/ takes the same)."""

    model = forms.CharField(max_length=63, required=False)
    status = forms.ChoiceField(choices=[("", "any"), *BuildStatus.choices], required=False)
    host = forms.CharField(max_length=63, required=False)
    before = forms.IntegerField(min_value=1, max_value=DB_INT_MAX, required=False, widget=forms.HiddenInput)


class EventFilterForm(forms.Form):
    """The events page's filters (the API's /api/events/ takes the same)."""

    kind = forms.CharField(max_length=64, required=False, help_text="exact, or a prefix ending in '.'")
    actor = forms.CharField(max_length=150, required=False, label="User")
    host = forms.CharField(max_length=63, required=False)
    deployment = forms.IntegerField(min_value=1, max_value=DB_INT_MAX, required=False, label="Deployment id")
    build = forms.IntegerField(min_value=1, max_value=DB_INT_MAX, required=False, label="Build id")
    model = forms.IntegerField(min_value=1, max_value=DB_INT_MAX, required=False, label="Model id")
    before = forms.IntegerField(min_value=1, max_value=DB_INT_MAX, required=False, widget=forms.HiddenInput)


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
        # An engine is compiled on a GPU, with a builder the host has: only such hosts are offered.
        builders = {h: build_spec.builder_choices(h) for h in host_selectors.host_list() if h.gpus.all()}
        hosts = [h for h, choices in builders.items() if choices]
        self.fields["host"].choices = [(h.name, f"{h.name} ({len(h.gpus.all())} GPU)") for h in hosts]
        self.fields["image"].choices = [(i, i) for i in sorted({i for h in hosts for i in builders[h]})]

    @property
    def unavailable(self) -> str:
        """Why no build can be requested here now ("" when one can)."""
        if self.fields["host"].choices:
            return ""
        return (
            "No host can build an engine now: a build needs a host with a GPU and a builder image that is "
            "allow-listed (GANTRY_BUILDER_IMAGES) and present on it, or TensorRT-LLM installed there "
            "(GANTRY_TRTLLM_PYTHON). Plain HuggingFace LLMs deploy without an engine."
        )


def show_refusal(form: forms.Form, exc: GantryError, *, within: str = "") -> None:
    """A service's refusal, shown on the form: each rule beside its field where the
    form has it (a form whose fields are those of the API's ``within`` object, e.g.
    a build's ``spec``, finds ``spec.max_seq_len`` at ``max_seq_len``)."""
    if isinstance(exc, ValidationFailed):
        for path, errors in exc.errors.items():
            field = path.removeprefix(f"{within}.") if within else path
            form.add_error(field if field in form.fields else None, " ".join(errors))
    else:
        form.add_error(None, str(exc))


class DashboardFilterForm(forms.Form):
    """The dashboard's deployment search: by name, status, or a host carrying a replica."""

    q = forms.CharField(required=False, max_length=63, label="Name contains")
    status = forms.ChoiceField(required=False, choices=[("", "any status"), *DeploymentStatus.choices])
    host = forms.CharField(required=False, max_length=63, label="On host")
