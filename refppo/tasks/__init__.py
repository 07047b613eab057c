"""Offline toy tasks: small environments whose quantities the chapters can compute exactly."""
