"""Colours that read alike on Streamlit's light and dark themes: WCAG contrast, and the muted colour of a cell
that only inherits an error. Pure functions on "#rrggbb" / "rgb(r, g, b)" strings, no streamlit."""

from __future__ import annotations

import colorsys
import math

import plotly.colors as plotly_colors

LIGHT_BACKGROUND = "#ffffff"
DARK_BACKGROUND = "#0e1117"
"""Streamlit's light and dark page backgrounds; the figures draw on them (they set no background of their own)."""


def rgb_of(colour: str) -> tuple[float, float, float]:
    """(r, g, b) in 0..255 of "#rrggbb" or "rgb(r, g, b)"."""
    if colour.startswith("#"):
        return tuple(float(v) for v in plotly_colors.hex_to_rgb(colour))
    return tuple(float(v) for v in plotly_colors.unlabel_rgb(colour))


def relative_luminance(colour: str) -> float:
    """WCAG 2's relative luminance: 0 for black, 1 for white."""
    def linear(channel: float) -> float:
        c = channel / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb_of(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(first: str, second: str) -> float:
    """WCAG 2's contrast ratio, 1 (none) to 21 (black on white)."""
    lighter, darker = sorted((relative_luminance(first), relative_luminance(second)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


EVEN_LUMINANCE = math.sqrt((relative_luminance(LIGHT_BACKGROUND) + 0.05)
                           * (relative_luminance(DARK_BACKGROUND) + 0.05)) - 0.05
"""The luminance that contrasts equally with both backgrounds (about 4.3 : 1 with each)."""


def faded_colour(colour: str) -> str:
    """The muted colour of a cell that only inherits an error: the colour's hue at a third of its saturation, at
    EVEN_LUMINANCE, so it keeps one contrast on both themes. Fading by opacity mixed the colour into the page
    instead: a light pink on white but a near-black maroon, all but invisible, on the dark theme."""
    hue, _, saturation = colorsys.rgb_to_hls(*(c / 255 for c in rgb_of(colour)))
    low, high = 0.0, 1.0  # luminance grows with lightness at a fixed hue and saturation: bisect it
    for _ in range(30):
        middle = (low + high) / 2
        rgb = colorsys.hls_to_rgb(hue, middle, saturation / 3)
        if relative_luminance(_rgb_text(rgb)) < EVEN_LUMINANCE:
            low = middle
        else:
            high = middle
    return _rgb_text(colorsys.hls_to_rgb(hue, (low + high) / 2, saturation / 3))


def _rgb_text(rgb: tuple[float, float, float]) -> str:
    return "rgb({}, {}, {})".format(*(round(255 * c) for c in rgb))
