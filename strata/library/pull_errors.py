"""The errors of `strata pull` and /api/pull, shared by the pull and its file transfer."""

from __future__ import annotations

from strata.errors import StrataError


class PullError(StrataError, RuntimeError):
    """The model could not be fetched; the message says why and what to pick instead."""


class RepoNotFoundError(PullError):
    """The hub has no such repository (or it is private and no token was given)."""


class DownloadError(PullError):
    """The hub listed the model but a file did not arrive (network, disk, hub error)."""


class PullCancelled(PullError):
    """The caller stopped the pull (its `cancel` event was set); the partial file is kept, so
    the next pull of that file resumes where this one stopped."""


class BadListingError(PullError):
    """The hub's answer is not one Strata can act on safely: a file name that would leave the
    library, a commit that is not a git id, or no model listing at all (HF_ENDPOINT is not a
    hub)."""


class HubOfflineError(PullError):
    """huggingface_hub's offline mode (HF_HUB_OFFLINE) forbids reaching the hub."""
