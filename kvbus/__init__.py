"""kvbus"""
