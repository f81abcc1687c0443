"""The small pieces every part of Gantry may use: they import no app of Gantry's."""
