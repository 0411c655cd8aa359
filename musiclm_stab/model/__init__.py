"""The dual-stream music masked-LM: conv frontend -> span masking -> transformer -> acoustic + musical heads."""

from musiclm_stab.model.mert import MusicMLM, count_parameters
from musiclm_stab.model.objective import MLMOutput

__all__ = ["MLMOutput", "MusicMLM", "count_parameters"]
