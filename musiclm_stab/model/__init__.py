"""The dual-stream music masked-LM: conv frontend -> span masking -> transformer -> acoustic + musical heads."""

from musiclm_stab.model.mert import MLMOutput, MusicMLM, count_parameters

__all__ = ["MLMOutput", "MusicMLM", "count_parameters"]
