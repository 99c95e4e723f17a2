"""The page at `/` in a real headless Chromium (the system's, driven by Selenium through the
system's chromedriver): type a sentence, see its translation and the cross-attention heatmap.
Skips, saying why, where no Chromium, chromedriver or selenium is installed."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("starlette")
pytest.importorskip("hypercorn")

import train
from train import serving

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (BROWSER and DRIVER), reason="no Chromium and chromedriver installed "
                                "(Debian: apt-get install chromium chromium-driver)")


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_type_a_sentence_see_the_translation_and_the_heatmap(browser, tiny_torch_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with train.load(tiny_torch_run) as run, serving.Server(serving.app(run), port=0).start() as server:
        expected = run.translate(["dreiundvierzig", "neun"], beam=4)
        browser.get(server.url + "/")
        WebDriverWait(browser, 30).until(lambda d: "step 2" in d.find_element(By.ID, "model").text)
        browser.find_element(By.ID, "source").send_keys("dreiundvierzig\nneun")
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done"))
        assert browser.find_element(By.ID, "error").text == ""
        shown = [li.find_element(By.CLASS_NAME, "tgt").text for li in browser.find_elements(By.CSS_SELECTOR, "#translations li")]
        assert shown == [t.strip() for t in expected]  # the browser's text drops trailing blanks
        # the heatmap of the first sentence: a cell per (output token, source token), coloured
        canvas = browser.find_element(By.ID, "heatmap")
        assert int(canvas.get_attribute("width")) > 100 and int(canvas.get_attribute("height")) > 50
        colours = browser.execute_script(
            "const c = document.getElementById('heatmap'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "const seen = new Set(); for (let i = 0; i < d.length; i += 4 * 7) seen.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);"
            "return seen.size;")
        assert colours > 10  # cells of many weights, not a blank canvas
        layers = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#layer option")]
        heads = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#head option")]
        cfg = run.model_config
        assert len(layers) == cfg.num_decoder_layers + 1 and len(heads) == cfg.num_heads + 1
        assert browser.find_element(By.ID, "head").get_attribute("value") == "mean"  # the average by default
        before = canvas.screenshot_as_png
        browser.find_element(By.CSS_SELECTOR, "#head option[value='0']").click()  # one head: another picture
        assert canvas.screenshot_as_png != before
        browser.save_screenshot(str(tmp_path / "page.png"))
