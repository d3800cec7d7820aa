"""Typed text on the page is never dropped without a question, and what the page shows follows what the
server holds: the real page in Debian's Chromium (Playwright) against the real bot."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from tests.test_web_page import CHROMIUM, Watch, asked, logged_in, typed_at_the_end
from tests.web_support import running_bot

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt install chromium) for the browser test")


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")


async def test_the_file_editors_text_is_asked_about_before_edit_again_or_reset(tmp_path: Path) -> None:
    """Edit is a toggle: pressed again while editing, it closed the editor without a word; Reset… asked only
    about the reset ("the current text stays in the history"), while the typed text was in no version."""
    from playwright.async_api import async_playwright, expect

    watch, dialogs = Watch(), []
    async with running_bot(tmp_path) as bot, async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            async with logged_in(browser, bot, "ann", watch, dialogs=dialogs) as page:
                editor = await typed_at_the_end(page, "\n- an hour of typing")
                await page.get_by_test_id("edit").click()  # (dismissed: the editor stays, with the text)
                assert await asked(dialogs, 1) == ["Leave the editor? Your changes are not saved."]
                await page.get_by_test_id("reset").click()
                assert (await asked(dialogs, 2))[1] == "Leave the editor? Your changes are not saved."
                await expect(editor).to_have_value(re.compile("an hour of typing$"))
            async with logged_in(browser, bot, "ann", watch) as page:  # (each question accepted)
                await typed_at_the_end(page, "\n- dropped on purpose")
                await page.get_by_test_id("edit").click()  # (asked, accepted: the editor closes)
                await expect(page.get_by_test_id("editor")).to_have_count(0)
                await expect(page.get_by_test_id("edit")).to_have_attribute("aria-pressed", "false")
            assert not watch.problems, watch.problems
        finally:
            await browser.close()


async def test_admin_texts_are_asked_about_before_a_reload_or_another_servers_text(tmp_path: Path) -> None:
    """Saving one soul section drew the whole view again, and every other open editor went with it; the
    guidelines' server picker put another server's text in place of the typed one; a rule switch the server
    refused left its checkbox showing the rule off."""
    from playwright.async_api import async_playwright, expect

    watch, dialogs = Watch(), []
    async with running_bot(tmp_path) as bot, async_playwright() as p:
        texts = bot.app.storage.personas
        for name in ("Cora", "Vex"):
            row = await texts.get_persona(name)
            assert row is not None
            await texts.put("soul", str(row.id), "identity", f"You are {name}.", author="discord:999")
        await texts.put("guidelines", "discord:5", "", "Be kind here.", author="discord:999")
        await texts.put("rule", "*", "kind", "Be kind.", author="discord:999", enabled=True)
        await bot.app.personas.load()
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            async with logged_in(browser, bot, "999", watch, dialogs=dialogs) as page:
                await page.get_by_test_id("tab-admin").click()
                cora = page.get_by_test_id("persona-Cora").locator("details.persona-section")
                await cora.locator("summary").click()
                await cora.get_by_role("button", name="Edit Cora's").click()
                await cora.locator("textarea").fill("You are Cora, a long rewrite not saved yet.")
                vex = page.get_by_test_id("persona-Vex").locator("details.persona-section")
                await vex.locator("summary").click()
                await vex.get_by_role("button", name="Edit Vex's").click()
                await vex.locator("textarea").fill("You are Vex, edited.")
                await vex.get_by_role("button", name="Save").click()
                await expect(page.get_by_test_id("notice")).to_contain_text("Saved Vex")
                assert (await asked(dialogs, 1))[0].startswith("Saved. Show the new state now?")
                await expect(cora.locator("textarea")).to_have_value("You are Cora, a long rewrite not saved yet.")
                row = await texts.get_persona("Vex")
                assert row is not None
                assert [t.content for t in await texts.current("soul", str(row.id))] == ["You are Vex, edited."]

                await page.get_by_test_id("admin-nav-guidelines").click()  # (asked: dismissed, it stays)
                assert len(await asked(dialogs, 2)) == 2
                dialogs.clear()
            async with logged_in(browser, bot, "999", watch, dialogs=dialogs) as page:
                await page.get_by_test_id("tab-admin").click()
                await page.get_by_test_id("admin-nav-guidelines").click()
                area = page.get_by_test_id("guidelines-text")
                await area.fill("Every persona answers in English only.")
                picker = page.get_by_test_id("guidelines-server")
                before = await picker.input_value()
                await picker.select_option("discord:5")
                assert await asked(dialogs, 1) == ["Leave the editor? Your changes are not saved."]
                await expect(area).to_have_value("Every persona answers in English only.")
                await expect(picker).to_have_value(before)

                await page.get_by_test_id("admin-nav-rules").click()
                assert len(await asked(dialogs, 2)) == 2  # (the typed guidelines once more: dismissed)
            async with logged_in(browser, bot, "999", watch) as page:
                await page.get_by_test_id("tab-admin").click()
                await page.get_by_test_id("admin-nav-rules").click()
                box = page.get_by_test_id("rule-kind-enabled")
                await expect(box).to_be_checked()
                limiter = bot.server.context.auth.limiter
                while not await limiter.check("discord:999"):  # (0: counted; the changes of this minute used up)
                    pass
                await box.click()
                await expect(page.get_by_test_id("alert")).to_contain_text("too many changes")
                await expect(box).to_be_checked()  # the rule is still on
        finally:
            await browser.close()


async def test_an_expired_item_is_restored_on_the_page(tmp_path: Path) -> None:
    """The server restores an expired item (as !memory restore does), but the page offered Restore for
    forgotten items only, and its Pin button answered "restore it first"."""
    from playwright.async_api import async_playwright, expect

    watch = Watch()
    async with running_bot(tmp_path) as bot, async_playwright() as p:
        pair = (await bot.app.cortex.store.pair_for("discord:ann", "Ann", "Cora"))[1]
        item = await bot.app.cortex.memory.remember(pair.id, "Ann is in Porto until Friday", expires_at=time.time() + 1)
        await asyncio.sleep(1.2)
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            async with logged_in(browser, bot, "ann", watch) as page:
                await page.get_by_test_id("tab-items").click()
                await page.get_by_test_id("items-archived").select_option("true")
                row = page.get_by_test_id(f"item-{item.id}")
                await expect(row).to_contain_text("expired")
                await expect(row.get_by_test_id(f"pin-{item.id}")).to_be_disabled()
                await row.get_by_test_id(f"restore-{item.id}").click()
                await expect(page.get_by_test_id("notice")).to_contain_text(f"#{item.id} is back.")
            restored = await bot.app.cortex.memory.get(pair.id, item.id, count_access=False)
            assert restored.visible and restored.expires_at is None
        finally:
            await browser.close()
