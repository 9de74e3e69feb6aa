"""Attention: transforms that act on the query and key weights of attention
heads after the optimizer (QK-Clip), and the declaration of where heads lie."""
